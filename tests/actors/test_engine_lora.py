"""The generator samples with the adapter it was sent (learner.lora.sync = "adapter", actors/engine/adapters.py): a vLLM engine
started with LoRA takes adapter-only updates, the header and frames the learner's publisher sends, and samples
greedily exactly as transformers does with that peft adapter merged into the model.

One engine start (the slow part) for all of it: before any adapter it samples the base model; adapter v1 and v2
(peft `get_peft_model` on the tiny model, every projection, lora_B set to non-zero values) each make the tokens
transformers makes with the merged peft model, and not the base model's; an inflight load of v2 leaves the requests
added with v1 on v1 to their end (every token stamped 1) while new requests sample v2 (stamped 2), after which v1's
adapter is gone from vLLM and from disk; a full-weights update or an adapter vLLM cannot apply is refused with
`WeightsRejected` and changes nothing.

The engine is configured to sample (temperature 1, top-p 0.9) and every request above asks for greedy decoding
itself (`add(..., temperature=0)`, as eval requests do). At the end, two greedy requests of one prompt batched with
sampled ones give the same tokens: greedy decoding takes the argmax of the same logits (the same weights and
adapter, the same prefix), so nothing random can enter; and the engine's own sampling parameters stay as configured
(a request's are a copy). This engine serves that check too, so the suite starts one vLLM engine for both.

Numerics: both sides run float32 (the tiny model's bf16 weights upcast) so greedy choices are compared where they
are well separated. vLLM computes x W + s (x A) B where transformers' merged model computes x (W + s A B): the same
sums reassociated, a difference of about (reduction length <= 128) x 2^-24 relative per product, ~1e-5 on logits
under 1 in magnitude. Every greedy step of the reference has its best token ahead of the second by more than
MIN_GAP = 1e-3 (checked), a hundred times that, so no token can flip on any CPU.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

PROMPTS = [[1, 17, 300, 42, 9, 1024], [1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2000, 3000, 4000]]
MAX_TOKENS = 8
RANK, ALPHA = 8, 16.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MIN_GAP = 1e-3  # see the module docstring
EOS = 2  # the tiny model's end of sequence (vLLM stops there; so does transformers' generate below)


def _peft_adapter(model_dir: Path, seed: int):
    """(the adapter's tensors under the wire's names, transformers' greedy tokens of the merged model per prompt,
    the smallest gap between the best and second-best logit over those steps)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # A: peft's scale; B non-zero (peft starts it at 0)
            scale = parameter.shape[1] ** -0.5 if "lora_A" in name else 0.5
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    arrays = {
        name.removeprefix("base_model.model."): tensor.detach().contiguous().numpy()
        for name, tensor in get_peft_model_state_dict(model).items()
    }
    merged = model.merge_and_unload().eval()
    tokens, gap = [], np.inf
    for prompt in PROMPTS:
        out = merged.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=EOS,
            output_scores=True,
            return_dict_in_generate=True,
        )
        tokens.append(out.sequences[0, len(prompt) :].tolist())
        for scores in out.scores:
            best, second = scores[0].topk(2).values.tolist()
            gap = min(gap, best - second)
    return arrays, tokens, gap


def _update(arrays: dict[str, np.ndarray], version: int, lora: bool = True):
    from actors.weights.updates import WeightsUpdate
    from common.weights import check_frames
    from launch.testing import pack_weights

    header, buckets = pack_weights(arrays, version, 1 << 20)
    if lora:
        header = dataclasses.replace(header, lora_rank=RANK, lora_alpha=ALPHA, lora_target_modules=TARGETS)
    return WeightsUpdate(header, check_frames(header, [memoryview(b) for b in buckets]), time.monotonic())


def _add(engine, tag: str) -> list[str]:
    ids = [f"{tag}:{i}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS):
        engine.add(request_id, prompt, temperature=0.0)  # greedy in a sampling engine (module docstring)
    return ids


def _run(engine) -> dict:
    finished = {}
    while engine.num_unfinished():
        for sample in engine.step():
            finished[sample.request_id] = sample
    return finished


def _greedy(engine, tag: str) -> list:
    ids = _add(engine, tag)
    finished = _run(engine)
    return [finished[request_id] for request_id in ids]


def test_the_engine_samples_with_the_adapter_it_was_sent(tiny_model_dir: Path) -> None:
    from actors.engine.api import SamplingSettings
    from actors.engine.vllm import VllmEngine, configure_cpu_environment
    from actors.weights.updates import WeightsRejected
    from common.config import GeneratorConfig, ModelConfig

    v1_arrays, v1_reference, v1_gap = _peft_adapter(tiny_model_dir, seed=6)
    v2_arrays, v2_reference, v2_gap = _peft_adapter(tiny_model_dir, seed=3)
    assert min(v1_gap, v2_gap) > MIN_GAP, "the reference's greedy choices must be well separated (module docstring)"
    assert v1_reference != v2_reference

    configure_cpu_environment(GeneratorConfig(kv_cache_gib=1.0))
    settings = SamplingSettings(temperature=1.0, top_p=0.9, max_tokens=MAX_TOKENS, seed=0)
    model = ModelConfig(path=str(tiny_model_dir), max_model_len=256, dtype="float32")
    engine = VllmEngine(tiny_model_dir, model, settings, 8, True, lora_rank=RANK)
    try:
        base = [s.completion_tokens.tolist() for s in _greedy(engine, "base")]

        engine.load_weights(_update(v1_arrays, 1), inflight=False)
        assert engine.policy_version == 1 and engine.last_load_path == "adapter"
        v1 = _greedy(engine, "v1")
        assert [s.completion_tokens.tolist() for s in v1] == v1_reference
        assert v1_reference != base  # the adapter changed what is sampled
        assert all(set(s.token_versions.tolist()) == {1} for s in v1)

        # inflight: requests added with v1 are one step in when v2 arrives
        old_ids = _add(engine, "old")
        assert not engine.step()
        v1_dir = Path(engine._adapters.current.request.lora_path)
        engine.load_weights(_update(v2_arrays, 2), inflight=True)
        new_ids = _add(engine, "new")
        finished = _run(engine)
        assert [finished[i].completion_tokens.tolist() for i in old_ids] == v1_reference
        assert all(set(finished[i].token_versions.tolist()) == {1} for i in old_ids)
        assert [finished[i].completion_tokens.tolist() for i in new_ids] == v2_reference
        assert all(set(finished[i].token_versions.tolist()) == {2} and finished[i].start_version == 2 for i in new_ids)
        for i in old_ids:  # behaviour log-probs are v1's: those of the v1 run, token for token
            np.testing.assert_array_equal(finished[i].behaviour_logprobs, v1[old_ids.index(i)].behaviour_logprobs)
        assert set(engine.engine.list_loras()) == {3} and not v1_dir.exists()  # v1 unused: removed

        with pytest.raises(WeightsRejected, match="full-weights update"):
            engine.load_weights(_update({"model.norm.weight": np.ones(64, np.float32)}, 3, lora=False), False)
        beyond = {name.replace("layers.1.", "layers.7.", 1): array for name, array in v1_arrays.items()}
        with pytest.raises(WeightsRejected, match="'model.layers.7.self_attn.q_proj' is not a linear layer"):
            engine.load_weights(_update(beyond, 3), inflight=False)  # vLLM itself would take it and ignore it
        wide = {**v1_arrays, "model.layers.0.mlp.down_proj.lora_A.weight": np.zeros((RANK, 64), np.float32)}
        with pytest.raises(WeightsRejected, match=r"down_proj.lora_A.weight' has shape \[8, 64\].*needs \[8, 128\]"):
            engine.load_weights(_update(wide, 3), inflight=False)
        assert engine.policy_version == 2
        assert [s.completion_tokens.tolist() for s in _greedy(engine, "after")] == v2_reference

        prompt = PROMPTS[0]  # greedy requests batched with sampled ones (module docstring)
        engine.add("greedy-a", prompt, temperature=0.0)
        for i in range(3):
            engine.add(f"sampled-{i}", prompt)  # the configured temperature 1, top-p 0.9
        engine.add("greedy-b", prompt, max_tokens=MAX_TOKENS, temperature=0.0)
        engine.add("short", prompt, max_tokens=3, temperature=0.5)
        finished = _run(engine)
        params = engine.params
    finally:
        engine.shutdown()
    assert finished["greedy-a"].completion_tokens.tolist() == finished["greedy-b"].completion_tokens.tolist()
    assert finished["greedy-a"].completion_tokens.tolist() == v2_reference[0]
    assert len(finished["short"].completion_tokens) <= 3
    assert (params.temperature, params.top_p, params.max_tokens) == (1.0, 0.9, MAX_TOKENS)  # untouched by the copies
