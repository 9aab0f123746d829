"""Greedy samples of a few fixed prompts from a vLLM engine on the CPU backend (tests/actors/test_engine_load.py).

In the test process: `engine(model_dir, dtype)` starts the engine (model.dtype `dtype`), `greedy(engine)` samples
PROMPTS. As its own process, `python -m tests.actors.greedy_engine MODEL_DIR OUT [DTYPE]` starts a fresh engine on
MODEL_DIR the same way, samples
PROMPTS and writes them to the file OUT as JSON, `[[tokens, logprobs], ...]` (Python's float repr round-trips every
float32 log-prob exactly; a file, because vLLM's processes log to stdout). The test starts it while its own engine
works, so that the two engines start side by side.

Failure modes: an engine that cannot start raises (as a process: a traceback on stderr, exit status 1, no OUT).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PROMPTS = [[1, 17, 300, 42, 9, 1024], [1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2000, 3000, 4000]]
MAX_TOKENS = 8


def engine(model_dir: Path, dtype: str = "auto"):
    from actors.engine.api import SamplingSettings
    from actors.engine.vllm import VllmEngine, configure_cpu_environment
    from common.config import GeneratorConfig, ModelConfig

    configure_cpu_environment(GeneratorConfig(kv_cache_gib=1.0))
    settings = SamplingSettings(temperature=0.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=0)
    model = ModelConfig(path=str(model_dir), dtype=dtype, max_model_len=256)
    return VllmEngine(model_dir, model, settings, 8, True)


def greedy(engine) -> list[tuple[list[int], list[float]]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add(f"{engine.policy_version}:{i}:0", prompt)
    finished = {}
    while engine.num_unfinished():
        for sample in engine.step():
            finished[sample.request_id] = sample
    ordered = [finished[f"{engine.policy_version}:{i}:0"] for i in range(len(PROMPTS))]
    return [(s.completion_tokens.tolist(), s.behaviour_logprobs.tolist()) for s in ordered]


def main(model_dir: str, out: str, dtype: str = "auto") -> None:
    fresh = engine(Path(model_dir), dtype)
    try:
        samples = greedy(fresh)
    finally:
        fresh.shutdown()
    Path(out).write_text(json.dumps(samples))


if __name__ == "__main__":
    main(*sys.argv[1:4])
