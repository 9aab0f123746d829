"""Sampling a fixed list of prompts to the end, outside the generator's loop: what `tandem eval` generates with.

    engine = open_eval_engine(model_path, config.model, config.generator, temperature=0.0, max_tokens=64, seed=0)
    try:
        groups = sample_completions(engine, records, samples=1)   # groups[p] = the completions of records[p]
    finally:
        engine.shutdown()

Any `Engine` drives it (vLLM, or the simulation engine in tests): every prompt's `samples` requests are queued at
once and the engine batches them (continuous batching, up to its `max_num_seqs`), stepping until none is left.
Temperature 0 is greedy decoding (then `samples` > 1 would repeat one completion, which the caller refuses).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from actors.engine.api import Engine, SamplingSettings
from common.config import GeneratorConfig, ModelConfig
from common.eval_metrics import Completion
from common.tasks import PromptRecord

log = logging.getLogger("tandem.actors.offline_sampling")

EVAL_MAX_NUM_SEQS = 128  # sequences one engine step runs at most; SmolLM2's ~130-token evals fit in 1 GiB of KV


def open_eval_engine(
    model_path: Path,
    model: ModelConfig,
    generator: GeneratorConfig,
    *,
    temperature: float,
    max_tokens: int,
    seed: int,
    max_num_seqs: int = EVAL_MAX_NUM_SEQS,
) -> Engine:
    """A vLLM engine on `model_path` sampling at `temperature` (0 = greedy, top-p 1) up to `max_tokens` tokens,
    with the generator's CPU settings (`generator.kv_cache_gib`, and `generator.cpu_cores`, which pins this process
    and the engine's workers, as a generator is pinned). Raises ValueError when `max_tokens` does not fit in
    `model.max_model_len` with room for a prompt, and what vLLM raises for a model it cannot load."""
    if max_tokens >= model.max_model_len:
        raise ValueError(
            f"max_tokens = {max_tokens} leaves no room for a prompt in model.max_model_len = {model.max_model_len}: "
            "lower max_tokens (tandem eval --max-tokens) or raise model.max_model_len"
        )
    from actors.engine.vllm import VllmEngine, configure_cpu_environment

    log.info("engine environment: %s", configure_cpu_environment(generator))
    settings = SamplingSettings(temperature=temperature, top_p=1.0, max_tokens=max_tokens, seed=seed)
    return VllmEngine(
        model_path,
        model,
        settings,
        max_num_seqs,
        generator.enforce_eager,
        generator.tensor_parallel_size,
        gpu_memory_utilization=generator.gpu_memory_utilization,
    )


def sample_completions(engine: Engine, prompts: Sequence[PromptRecord], samples: int) -> list[list[Completion]]:
    """`samples` completions of every prompt, `result[p][j]` the j-th of `prompts[p]` (rendered with the engine's
    chat template, `common.tasks.render_prompt`). Returns when every request has finished; the engine is left
    empty. Raises ValueError for `samples` < 1."""
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    started = time.monotonic()
    for p, record in enumerate(prompts):
        tokens = engine.render(record)  # type: ignore[arg-type]  # a PromptRecord has the messages render reads
        for j in range(samples):
            engine.add(f"eval:{p}:{j}", tokens)
    results: list[list[Completion | None]] = [[None] * samples for _ in prompts]
    generated = 0
    while engine.num_unfinished():
        for sample in engine.step():
            _, p, j = sample.request_id.split(":")
            text = engine.decode(sample.completion_tokens)
            results[int(p)][int(j)] = Completion(text, len(sample.completion_tokens), sample.finish_reason)
            generated += len(sample.completion_tokens)
    seconds = time.monotonic() - started
    log.info(
        "sampled %d completions of %d prompts: %d tokens in %.1fs (%.0f tok/s)",
        len(prompts) * samples,
        len(prompts),
        generated,
        seconds,
        generated / max(seconds, 1e-9),
    )
    missing = sum(c is None for group in results for c in group)
    if missing:  # the Engine contract returns every request once: an engine that broke it is a bug, not a result
        raise RuntimeError(f"the engine finished with {missing} of {len(prompts) * samples} requests never returned")
    return [[c for c in group if c is not None] for group in results]
