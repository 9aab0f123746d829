"""What the generator benchmarks share: the model they run and the prompts they lease (the generator process and
its fake peers come from `launch.testing`).

model_dir, model_name = benchmark_model()          # SmolLM2-135M if prepared, else the tiny random model
prompts = task_items(16)                           # the embedded arithmetic task, as the buffer leases it
"""

from __future__ import annotations

from pathlib import Path

from common.model_prep import MANIFEST, SMOLLM2_DIRNAME, default_cache_dir, make_tiny_model
from common.types import PromptItem


def benchmark_model() -> tuple[Path, str]:
    """SmolLM2-135M-Instruct when `tandem prepare-model` has built it, else the tiny random model (and say so)."""
    smollm2 = default_cache_dir() / SMOLLM2_DIRNAME
    if (smollm2 / MANIFEST).is_file():
        return smollm2, "SmolLM2-135M-Instruct"
    return make_tiny_model(default_cache_dir() / "tiny-llama", seed=0), "tiny random Llama (SmolLM2 not prepared)"


def task_items(count: int, first_id: int = 0) -> list[PromptItem]:
    """The embedded task's prompts as the buffer would lease them."""
    from common.tasks import arithmetic_prompts

    records = arithmetic_prompts(first_id + count, seed=0, difficulty=2)[first_id:]
    return [PromptItem(r.prompt_id, 0, r.messages, dict(r.metadata)) for r in records]
