"""End to end: `tandem run` with the tiny model, real vLLM, real DeepSpeed, real sockets, for a few steps.

At η = 0 and η = 2: every process exits cleanly, metrics.jsonl has the documented keys, no trained sample is
staler than η, the buffer's accounting identity holds, and no process of the run outlives the launcher.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.metrics import read_metrics
from launch.testing import free_port, loopback_overrides, override_args
from tests.launch.ray_runs import buffer_counters, processes_of

pytestmark = pytest.mark.integration  # starts role processes

REQUIRED_KEYS = {
    "step",
    "policy_version",
    "time",
    "reward/mean",
    "staleness/mean",
    "staleness/max",
    "buffer/dropped_stale",
    "perf/train_tokens_per_s",
    "throughput/samples_per_s",
    "throughput/tokens_per_s",
    "loss/policy",
    "policy/kl",
}


def run_tandem(tmp_path: Path, model_dir: Path, eta: int, steps: int = 4) -> tuple[subprocess.CompletedProcess, Path]:
    name = f"e2e-eta{eta}"
    overrides = {
        "run.root": str(tmp_path),
        "run.name": name,
        "model.path": str(model_dir),
        "algo.max_staleness": eta,
        "learner.total_steps": steps,
        **loopback_overrides(free_port(), free_port()),
    }
    # the command line a user types (TOML file + overrides), not a resolved config: this is the path under test
    argv = [
        sys.executable,
        "-m",
        "launch.cli",
        "run",
        str(Path(__file__).parent / "e2e.toml"),
        *override_args(overrides),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    return result, tmp_path / name


@pytest.mark.parametrize("eta", [0, 2])
def test_tandem_run_end_to_end(tmp_path: Path, tiny_model_dir: Path, eta: int) -> None:
    result, run_dir = run_tandem(tmp_path, tiny_model_dir, eta)
    assert result.returncode == 0, f"tandem run failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    assert not processes_of(run_dir), "processes of the run outlived the launcher"

    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)) and len(records) == 4
    for record in records:
        assert REQUIRED_KEYS <= record.keys(), REQUIRED_KEYS - record.keys()
        assert record["staleness/max"] <= eta
    assert records[-1]["policy_version"] == 4

    c = buffer_counters(run_dir)  # written by the buffer as it stops
    assert c["arrived"] == c["trained"] + c["dropped_stale"] + c["evicted"] + c["rejected"] + c["buffered"]
    assert c["served"] >= 4 * 2 * 4  # steps x groups_per_step x group_size samples
    if eta == 0:
        assert c["dropped_stale"] == 0  # synchronous: admission alone keeps every sample fresh
    assert "run finished" in result.stdout and "tensorboard --logdir" in result.stdout
    assert (run_dir / "config.json").is_file() and any((run_dir / "tb").iterdir())
