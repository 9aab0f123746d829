"""What the generator benchmarks share: the model they run, and a `tandem generator` process beside fake peers.

model_dir, model_name = benchmark_model()          # SmolLM2-135M if prepared, else the tiny random model
with generator_process(config_path, log_dir) as process:
    ...                                             # killed with its vLLM children on the way out
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from common.model_prep import MANIFEST, SMOLLM2_DIRNAME, default_cache_dir, make_tiny_model
from common.types import PromptItem
from tests.actors.fakes import REPO, generator_command


def benchmark_model() -> tuple[Path, str]:
    """SmolLM2-135M-Instruct when `tandem prepare-model` has built it, else the tiny random model (and say so)."""
    smollm2 = default_cache_dir() / SMOLLM2_DIRNAME
    if (smollm2 / MANIFEST).is_file():
        return smollm2, "SmolLM2-135M-Instruct"
    return make_tiny_model(default_cache_dir() / "tiny-llama", seed=0), "tiny random Llama (SmolLM2 not prepared)"


def arithmetic_items(count: int, first_id: int = 0) -> list[PromptItem]:
    """The embedded task's prompts as the buffer would lease them."""
    from common.tasks import arithmetic_prompts

    records = arithmetic_prompts(first_id + count, seed=0, difficulty=2)[first_id:]
    return [PromptItem(r.prompt_id, 0, r.messages, dict(r.metadata)) for r in records]


@contextlib.contextmanager
def generator_process(config_path: Path, log_path: Path) -> Iterator[subprocess.Popen]:
    """`tandem generator CONFIG` in its own session (stderr to `log_path`); SIGTERM, then SIGKILL to the group."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with log_path.open("w") as log:
        process = subprocess.Popen(
            generator_command(config_path), cwd=REPO, env=env, stderr=log, stdout=log, start_new_session=True
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
