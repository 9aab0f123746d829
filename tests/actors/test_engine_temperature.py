"""VllmEngine.add's per-request temperature (actors/engine.py): an eval request's greedy decoding (temperature 0)
inside an engine configured to sample at temperature 1.

Two greedy requests of one prompt, batched with sampled ones, must give the same tokens: greedy decoding takes the
argmax of the same logits (the same bf16 weights, the same prefix), so nothing random can enter. The engine's own
sampling parameters stay as configured (a request's are a copy).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

PROMPT = [1, 17, 300, 42, 9, 1024]
MAX_TOKENS = 12


def test_greedy_requests_are_deterministic_in_a_sampling_engine(tiny_model_dir: Path):
    from actors.engine import VllmEngine, configure_cpu_environment
    from actors.engine_api import SamplingSettings
    from common.config import GeneratorConfig, ModelConfig

    configure_cpu_environment(GeneratorConfig(kv_cache_gib=1.0))
    settings = SamplingSettings(temperature=1.0, top_p=0.9, max_tokens=MAX_TOKENS, seed=0)
    engine = VllmEngine(tiny_model_dir, ModelConfig(path=str(tiny_model_dir), max_model_len=256), settings, 8, True)
    try:
        engine.add("greedy-a", PROMPT, temperature=0.0)
        for i in range(3):
            engine.add(f"sampled-{i}", PROMPT)  # the configured temperature 1, top-p 0.9
        engine.add("greedy-b", PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
        engine.add("short", PROMPT, max_tokens=3, temperature=0.5)
        finished = {}
        while engine.num_unfinished():
            for sample in engine.step():
                finished[sample.request_id] = sample
        params = engine.params
    finally:
        engine.shutdown()
    greedy_a, greedy_b = finished["greedy-a"].completion_tokens, finished["greedy-b"].completion_tokens
    assert len(greedy_a) == MAX_TOKENS or finished["greedy-a"].finish_reason == "stop"
    assert greedy_a.tolist() == greedy_b.tolist()
    assert len(finished["short"].completion_tokens) <= 3
    assert (params.temperature, params.top_p, params.max_tokens) == (1.0, 0.9, MAX_TOKENS)  # untouched by the copies
