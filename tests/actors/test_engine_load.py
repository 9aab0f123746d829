"""VllmEngine.load_weights on the CPU backend: after in-place loads the engine samples exactly as a fresh engine
started on the new weights (actors/engine.py, `WeightLoader`).

The tiny model has tied input/output embeddings, so this also covers the output layer following the new embedding.
Greedy decoding (temperature 0) of a few prompts, compared token for token and log-prob for log-prob: both engines
run the same kernels on the same bf16 weights in the same batches, so nothing but a different weight (or a stale
repacked layer) can change a bit. Three loads (the new weights, the old ones back, the new ones again) also check
that the reused scratch weights and rebuilt oneDNN layers carry nothing from one load into the next.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

PROMPTS = [[1, 17, 300, 42, 9, 1024], [1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2000, 3000, 4000]]
MAX_TOKENS = 8


def _engine(model_dir: Path):
    from actors.engine import VllmEngine, configure_cpu_environment
    from actors.engine_api import SamplingSettings
    from common.config import GeneratorConfig, ModelConfig

    configure_cpu_environment(GeneratorConfig(kv_cache_gib=1.0))
    settings = SamplingSettings(temperature=0.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=0)
    return VllmEngine(model_dir, ModelConfig(path=str(model_dir), max_model_len=256), settings, 8, True)


def _greedy(engine) -> list[tuple[list[int], list[float]]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add(f"{engine.policy_version}:{i}:0", prompt)
    finished = {}
    while engine.num_unfinished():
        for sample in engine.step():
            finished[sample.request_id] = sample
    ordered = [finished[f"{engine.policy_version}:{i}:0"] for i in range(len(PROMPTS))]
    return [(s.completion_tokens.tolist(), s.behaviour_logprobs.tolist()) for s in ordered]


def _update(model_dir: Path, version: int):
    import torch
    from safetensors.torch import load_file

    from actors.weights import WeightsUpdate
    from common.weights import check_frames
    from launch.testing import pack_weights

    arrays, dtypes = {}, {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        arrays[name], dtypes[name] = tensor.contiguous().view(torch.uint16).numpy(), "bfloat16"
    header, buckets = pack_weights(arrays, version, 1 << 20, dtypes)
    return WeightsUpdate(header, check_frames(header, [memoryview(b) for b in buckets]), time.monotonic())


def test_in_place_loads_sample_exactly_as_a_fresh_engine_on_the_new_weights(tiny_model_dir: Path, tmp_path: Path):
    from common.model_prep import make_tiny_model

    new_dir = make_tiny_model(tmp_path / "seed1", seed=1)
    engine = _engine(tiny_model_dir)
    try:
        before = _greedy(engine)
        engine.load_weights(_update(new_dir, 1), inflight=False)
        assert engine.last_load_path == "in_place" and engine.policy_version == 1
        after_first = _greedy(engine)
        engine.load_weights(_update(tiny_model_dir, 2), inflight=False)
        back = _greedy(engine)
        engine.load_weights(_update(new_dir, 3), inflight=False)
        after_third = _greedy(engine)
    finally:
        engine.shutdown()
    fresh_engine = _engine(new_dir)
    try:
        fresh = _greedy(fresh_engine)
    finally:
        fresh_engine.shutdown()
    assert [t for t, _ in before] != [t for t, _ in fresh], "the two models must sample differently to tell them apart"
    assert back == before  # the old weights back: the old engine's samples, bit for bit
    for loaded in (after_first, after_third):
        for (tokens, logprobs), (fresh_tokens, fresh_logprobs) in zip(loaded, fresh):
            assert tokens == fresh_tokens
            np.testing.assert_array_equal(logprobs, fresh_logprobs)
