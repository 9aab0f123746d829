"""The CPU in-place load of a weights update into a vLLM worker's model (`actors.engine.vllm.WeightLoader` calls it in
each worker): the load a fresh engine's start does, replayed on the live model. Written against vllm 0.32.

    plan = InPlaceLoad.plan(model_runner)       # None: vLLM's layerwise reload is right (GPU, quantized, LoRA)
    loaded_at, repacked_at = plan.load(named_tensors)

vLLM's CPU kernels keep some weights repacked after loading (oneDNN handles of the linear layers and the output
layer; the fused-MoE experts in the grouped-gemm layout), and the layer's weight loaders write the checkpoint layout,
so each such layer loads into a scratch weight of its checkpoint shape, built from the metadata vLLM records for its
own reloads, which is then repacked by the same processing engine start ran. Failure modes: RuntimeError when an
update leaves a parameter unloaded, or (at the plan) when a CPU model has a fused-MoE layer this cannot load, for
which vLLM's layerwise reload is wrong (docs/models.md).
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("tandem.actors.engine")


class InPlaceLoad:
    """The CPU in-place load (see `actors.engine.vllm.WeightLoader`): scratch weights for the linear layers whose plain
    weight the CPU repack dropped and for the fused-MoE layers' experts, `model.load_weights`, then vLLM's
    `process_weights_after_loading` on the whole model and the experts' repack."""

    def __init__(self, runner: Any, scratch: list[tuple[Any, str, Any]], experts: list[tuple[Any, ...]]) -> None:
        self.runner = runner
        self.model = runner.get_model()
        self.scratch = scratch  # (layer, parameter name, its scratch weight)
        self.experts = experts  # (fused-MoE layer, its scratch w13_weight, its scratch w2_weight)

    @classmethod
    def plan(cls, runner: Any) -> InPlaceLoad | None:
        """None unless the platform is CPU and every quantization method in the model is vLLM's unquantized
        linear, embedding or fused-MoE one (their post-load processing is a repack from the plain weights, so
        running it again after a load is what engine start does); the reason is logged. Raises RuntimeError for a
        CPU model with a fused-MoE layer this load cannot take (`_moe_scratch`): vLLM's layerwise reload would
        leave its experts on weights the CPU kernel reads in another layout, i.e. sample from wrong weights."""
        from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        if runner.vllm_config.lora_config is not None:
            log.info("weights load: layerwise reload (LoRA wraps the layers)")
            return None
        model, scratch, experts, layerwise = runner.get_model(), [], [], None
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if not isinstance(method, QuantizeMethodBase):
                continue
            if isinstance(method, FusedMoEMethodBase):
                moe_scratch = _moe_scratch(name, module, method, model)
                scratch += moe_scratch
                experts.append((module, *(weight for _, _, weight in moe_scratch)))
                continue
            if layerwise is not None:
                continue
            if not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
                layerwise = ("weights load: layerwise reload (%s uses %s)", name, type(method).__name__)
                continue
            weight = getattr(module, "weight", None)
            if isinstance(method, UnquantizedLinearMethod) and weight is not None and weight.numel() == 0:
                restored = _scratch_weight(module)
                if restored is None:
                    layerwise = ("weights load: layerwise reload (no recorded weight metadata for %s)", name)
                    continue
                scratch.append((module, "weight", restored))
        if layerwise is not None:
            if experts:
                raise RuntimeError(
                    f"weights update: {layerwise[1]} needs vLLM's layerwise reload, which leaves the fused-MoE "
                    "layers of a CPU engine on un-repacked weights (docs/models.md): this model cannot take "
                    "full-weight updates on a CPU generator; run its generators on a GPU"
                )
            log.info(*layerwise)
            return None
        return cls(runner, scratch, experts)

    def load(self, weights: Any) -> tuple[float, float]:
        """Load `weights` (checkpoint names) and repack; returns perf_counter() after the copy and after the
        repack. Raises RuntimeError when a parameter got no tensor (nothing is repacked then: the engine must
        not go on with half an update, the generator exits and restarts)."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        for module, name, weight in self.scratch:
            setattr(module, name, weight)  # process_weights_after_loading repacks it and drops it again
        expected = {name for name, _ in self.model.named_parameters()}
        loaded = self.model.load_weights(weights)
        missing = expected - set(loaded or expected)
        if missing:
            raise RuntimeError(
                f"weights update left {len(missing)} parameters unloaded ({sorted(missing)[:4]}): its tensors do "
                "not cover the model (publish every tensor of the checkpoint, under its checkpoint name)"
            )
        loaded_at = time.perf_counter()
        model_config = self.runner.model_config
        process_weights_after_loading(self.model, model_config, self.runner.device)
        for layer, w13, w2 in self.experts:
            _repack_experts(layer, w13, w2)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights does
            if hasattr(self.runner, reset):
                getattr(self.runner, reset)()
        return loaded_at, time.perf_counter()


def _scratch_weight(module: Any, name: str = "weight") -> Any:
    """A plain parameter `name` for a repacked layer, in checkpoint layout with its weight loader: built from the
    metadata vLLM records at model creation for its own reloads (None where it has none)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    info = LAYERWISE_INFO.get(module)
    meta = info.restore_metadata[0].get(name) if info is not None else None
    if meta is None or getattr(meta, "weight_loader", None) is None:
        return None
    with info.restore_device:
        weight = restore_layer_refs(materialize_meta_tensor(meta), module)  # the copy's loader bound to the layer
    loader = weight.weight_loader
    while getattr(loader, "__name__", "") == "online_process_loader":  # wrapped by an earlier layerwise reload,
        loader = loader.__wrapped__  # which would only buffer the tensors: the layer's own loader copies them
    weight.weight_loader = loader
    return weight


def _moe_scratch(name: str, module: Any, method: Any, model: Any) -> list[tuple[Any, str, Any]]:
    """Scratch `w13_weight` / `w2_weight` (all experts stacked, as vLLM creates them: [E, 2I, H] and [E, H, I]) of
    a fused-MoE layer, loaded through the layer's own expert weight loader (expert and shard ids from the
    checkpoint names) and repacked by `_repack_experts`. The CPU experts pad and prepack both into the grouped-gemm
    layout after loading (vLLM's CPUUnquantizedExperts.process_weights_after_loading), so the live parameters no
    longer hold the layout the loader writes. Raises RuntimeError where this is not the whole story: another
    quantization method or backend, a parameter besides the two whose shape changed after loading (padded biases),
    or a router weight vLLM caches fused with the shared expert's gate (MoERunner._fse_fuse_gate), which no load
    refreshes."""
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    problem = None
    info = LAYERWISE_INFO.get(module)
    recorded = info.restore_metadata[0] if info is not None else {}
    if not isinstance(method, UnquantizedFusedMoEMethod) or method.unquantized_backend != UnquantizedMoeBackend.CPU:
        problem = f"it uses {type(method).__name__} ({getattr(method, 'unquantized_backend', 'quantized')})"
    elif method.moe_kernel is None:
        problem = "vLLM built no MoE kernel for it"
    elif any(getattr(m, "_fse_fuse_gate", False) for m in model.modules()):
        problem = "vLLM caches its router weight fused with the shared expert's gate"
    else:
        changed = [
            p
            for p, param in module.named_parameters(recurse=False)
            if p not in ("w13_weight", "w2_weight") and (p not in recorded or recorded[p].shape != param.shape)
        ]
        if changed:
            problem = f"its parameters {changed} changed shape after loading"
    scratch = [] if problem else [(module, p, _scratch_weight(module, p)) for p in ("w13_weight", "w2_weight")]
    if not problem and any(weight is None for _, _, weight in scratch):
        problem = "vLLM recorded no weight metadata for it"
    if problem:
        raise RuntimeError(
            f"weights update: the fused-MoE layer {name} cannot be reloaded in place on this CPU engine ({problem}), "
            "and vLLM's layerwise reload leaves CPU experts on un-repacked weights (docs/models.md): this model "
            "cannot take full-weight updates on a CPU generator; run its generators on a GPU"
        )
    return scratch


def _repack_experts(layer: Any, w13: Any, w2: Any) -> None:
    """Repack a CPU fused-MoE layer's freshly loaded plain experts as at engine start. vLLM 0.32 runs the experts'
    own processing (padding, the grouped-gemm prepack) only at the first `process_weights_after_loading`: on any
    later one (a weight update) UnquantizedFusedMoEMethod._setup_kernel copies the weights back as they are, and
    the kernel would read plain weights as prepacked ones (what vLLM's layerwise reload leaves: log-probs ~100x the
    float32 bound off, docs/models.md). So the layer still holds the scratch weights here, and the experts'
    `process_weights_after_loading` (the one engine start ran) repacks them into new parameters. A vLLM that
    repacks on updates itself replaces the parameters first: nothing is done then (twice would scramble them)."""
    if layer.w13_weight is not w13 or layer.w2_weight is not w2:
        if layer.w13_weight is w13 or layer.w2_weight is w2:
            raise RuntimeError(f"weights update: vLLM repacked only one of {layer.layer_name}'s expert weights")
        return
    layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)


def layerwise_reload_problem(runner: Any) -> str | None:
    """Why vLLM's layerwise reload would leave `runner`'s model on wrong weights (one line saying what to change),
    or None: a CPU model with fused-MoE layers, whose experts it copies back unpacked (`_repack_experts`)."""
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    for name, module in runner.get_model().named_modules():
        if isinstance(getattr(module, "quant_method", None), FusedMoEMethodBase):
            return (
                f'weights.transport = "broadcast" reloads through vLLM\'s layerwise reload, which leaves the '
                f"fused-MoE layer {name} of this CPU engine on un-repacked experts (docs/models.md): use "
                'weights.transport = "star" or "relay" for a mixture-of-experts model on CPU'
            )
    return None
