"""Greedy samples of a few fixed prompts from a vLLM engine on the CPU backend (tests/actors/test_engine_load.py).

In the test process: `engine(model_dir, dtype)` starts the engine (model.dtype `dtype`), `greedy(engine)` samples
PROMPTS. As its own process, `python -m tests.actors.greedy_engine MODEL_DIR OUT [DTYPE]` starts a fresh engine on
MODEL_DIR the same way, samples PROMPTS and writes them to the file OUT as JSON, `[[tokens, logprobs], ...]`
(Python's float repr round-trips every float32 log-prob exactly; a file, because vLLM's processes log to stdout). The
test starts it while its own engine works, so that the two engines start side by side.

The two engines compute with one OpenMP thread each, so that they split a batch's work the same way on any machine
(a reduction split over another number of threads may round differently):
  * the engine in the test process runs its engine core in a process of its own, as the generator does, bound to
    one core (`one_thread_binding`);
  * the fresh one runs its engine core in its own process, not in two more (VLLM_ENABLE_V1_MULTIPROCESSING=0: one
    interpreter importing vLLM instead of three; on a 2-core AVX2 EPYC 17 s instead of 36 s), where vLLM sets torch
    to one thread for serving (vllm.utils.torch_utils). Its samples are the test's reference, not its subject, and
    the tiny dense and MoE models sample bit for bit the same either way.

Failure modes: an engine that cannot start raises (as a process: a traceback on stderr, exit status 1, no OUT).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

PROMPTS = [[1, 17, 300, 42, 9, 1024], [1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2000, 3000, 4000]]
MAX_TOKENS = 8


@contextlib.contextmanager
def one_thread_binding() -> Iterator[None]:
    """While an engine starts: its engine core's OpenMP threads bound to one core this process may use (vLLM reads
    VLLM_CPU_OMP_THREADS_BIND when it starts the engine core; the variable is put back afterwards, so that later
    tests' processes do not inherit it)."""
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(min(os.sched_getaffinity(0)))
    try:
        yield
    finally:
        if before is None:
            del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


def engine(model_dir: Path, dtype: str = "auto", **options: object):
    """A greedy engine on `model_dir` (`options`: VllmEngine's, e.g. broadcast=True)."""
    from actors.engine.api import SamplingSettings
    from actors.engine.vllm import VllmEngine, configure_cpu_environment
    from common.config import GeneratorConfig, ModelConfig

    configure_cpu_environment(GeneratorConfig(kv_cache_gib=1.0))
    settings = SamplingSettings(temperature=0.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=0)
    model = ModelConfig(path=str(model_dir), dtype=dtype, max_model_len=256)
    with one_thread_binding():  # read only where the engine core has a process of its own (not in main's)
        return VllmEngine(model_dir, model, settings, 8, True, **options)


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
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process (the module docstring)
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread even where the caller set more (vLLM keeps a count set here)
    fresh = engine(Path(model_dir), dtype)
    try:
        samples = greedy(fresh)
    finally:
        fresh.shutdown()
    Path(out).write_text(json.dumps(samples))


if __name__ == "__main__":
    main(*sys.argv[1:4])
