"""Every tiny architecture family (common.tiny_models) in the suite, sized for its cost (docs/models.md):

  * every family, no process: the learner's weights under checkpoint names (learners/checkpoint_names.py) are
    exactly what `save_pretrained` writes, name for name and bit for bit (what vLLM and the HF export read);
  * every family, DeepSpeed in-process: one ZeRO-1 step of the project's Trainer, its HF export reloaded with
    AutoModelForCausalLM giving the trainer's logits bit for bit (benchmarks.architectures.train_and_export);
  * two families through the whole loop (one vLLM engine each): qwen3 (dense, untied head) and qwen3_moe (experts
    fused in transformers 5, split per expert for vLLM): sample, ZeRO-1, ZeRO-3, the ZeRO-3 weights published to
    the engine, loaded in place (the fused-MoE experts too: actors/weights/in_place_load.py), and its log-probs against
    transformers' within the derived float32 bound (benchmarks.architectures.logprob_tolerance).
The whole matrix (every family through the whole loop) is benchmarks/architectures.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from common.tiny_models import MOE_FAMILIES, TINY_FAMILIES, TINY_MODELS

FULL_PATH = ("qwen3", "qwen3_moe")


@pytest.fixture(scope="module")
def family_dirs() -> dict[str, Path]:
    """Each family's tiny model in the model cache (built once per cache, ~1 s each; reused afterwards)."""
    from common.model_prep import resolve_model_path

    return {family: resolve_model_path(f"tiny:{family}") for family in TINY_FAMILIES}


def test_tiny_paths_name_their_family_and_refuse_others(family_dirs: dict[str, Path]) -> None:
    import json

    from common.config import BUILT_IN_MODELS
    from common.model_prep import model_vocab_size, resolve_model_path

    assert set(TINY_MODELS) <= set(BUILT_IN_MODELS)
    architectures = {f: json.loads((d / "config.json").read_text())["architectures"][0] for f, d in family_dirs.items()}
    assert architectures["qwen3_moe"] == "Qwen3MoeForCausalLM" and architectures["phi3"] == "Phi3ForCausalLM"
    assert len(set(architectures.values())) == len(TINY_FAMILIES)  # one architecture per family
    assert resolve_model_path("tiny:llama") == resolve_model_path("tiny")
    assert model_vocab_size("tiny:gemma3") == 49152
    with pytest.raises(ValueError, match="tiny:qwen3_moe"):
        resolve_model_path("tiny:qwen4")


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_checkpoint_names_are_what_save_pretrained_writes(family: str, family_dirs: dict[str, Path]) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from learners.checkpoint_names import checkpoint_layout, checkpoint_weights

    model = AutoModelForCausalLM.from_pretrained(str(family_dirs[family]), dtype=torch.bfloat16)
    saved = load_file(str(family_dirs[family] / "model.safetensors"))
    named = [(name, param.detach()) for name, param in model.named_parameters()]
    layout = checkpoint_layout(model, [(name, t.dtype, list(t.shape)) for name, t in named])
    weights = list(checkpoint_weights(model, iter(named)))
    assert [name for name, _, _ in layout] == [name for name, _ in weights]  # the header's order is the stream's
    assert {name: shape for name, _, shape in layout} == {name: list(t.shape) for name, t in saved.items()}
    assert all(torch.equal(tensor, saved[name]) for name, tensor in weights)
    if family in MOE_FAMILIES:  # what was published before: fused names vLLM has no parameter for
        assert {name for name, _ in named} != set(saved)


@pytest.mark.deepspeed
@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_a_zero1_step_and_its_export_for_every_family(
    family: str, family_dirs: dict[str, Path], dist: object, tmp_path: Path
) -> None:
    from benchmarks.architectures import train_and_export

    train_and_export(family_dirs[family], 1, tmp_path, dist)


@pytest.mark.vllm
@pytest.mark.deepspeed
@pytest.mark.parametrize("family", FULL_PATH)
def test_the_whole_loop(family: str, dist: object, tmp_path: Path) -> None:
    from benchmarks.architectures import PARTS, check_family

    record = check_family(family, tmp_path, dist)
    assert set(record["parts"]) == set(PARTS)
    failed = {part: value for part, value in record["parts"].items() if value["status"] != "passed"}
    assert not failed, f"{family}: {failed}"
    update = record["parts"]["update"]
    assert update["load_path"] == "in_place"  # never vLLM's layerwise reload, which is wrong for CPU experts
    assert update["new_over_tolerance"] <= 1.0 and update["old_over_tolerance"] > 10.0
