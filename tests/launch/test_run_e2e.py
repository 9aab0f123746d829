"""End to end: `tandem run` with the tiny model, real vLLM, real DeepSpeed, real sockets, for a few steps.

At η = 0 and η = 2: every process exits cleanly, metrics.jsonl has the documented keys, no trained sample is
staler than η, the buffer's accounting identity holds, and no process of the run outlives the launcher.

The two runs are started together (one module fixture) and each test checks its own: they share nothing but the
machine (own ports, own run directory, own processes). Most of a run's wall time is its generator starting vLLM on
the generators' cores (launch.local.plan_cores: the first half of the machine) while the learner's half waits, so
the η = 2 run is pinned the other way round (its generator on the learner's half, written as generator.cpu_cores
and learner.cpu_cores), and side by side the two take little more than one run alone. The η = 0 run keeps the
planned split. Nothing checked depends on how fast a run goes: η bounds staleness by admission, whatever the load.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
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


ETAS = (0, 2)
MIRRORED_ETA = 2  # the run pinned the other way round (see the module docstring)
STEPS = 4
RUN_TIMEOUT_S = 600  # each run's bound before (subprocess.run's timeout)


def mirrored_cores() -> dict[str, str]:
    """generator.cpu_cores / learner.cpu_cores the other way round from launch.local.plan_cores (the generators on
    the second half of this machine's cores, the learner on the first); none on one core."""
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        return {}
    half = len(available) // 2
    return {
        "generator.cpu_cores": ",".join(map(str, available[half:])),
        "learner.cpu_cores": ",".join(map(str, available[:half])),
    }


def start_tandem(root: Path, model_dir: Path, eta: int) -> tuple[subprocess.Popen, Path]:
    """`tandem run e2e.toml OVERRIDES` started (not waited for); its output goes to files in `root`."""
    name = f"e2e-eta{eta}"
    overrides = {
        **(mirrored_cores() if eta == MIRRORED_ETA else {}),
        "run.root": str(root),
        "run.name": name,
        "model.path": str(model_dir),
        "algo.max_staleness": eta,
        "learner.total_steps": STEPS,
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
    with open(root / f"{name}.stdout", "w") as out, open(root / f"{name}.stderr", "w") as err:
        return subprocess.Popen(argv, stdout=out, stderr=err, text=True), root / name


@dataclass
class Finished:
    code: int
    stdout: str
    stderr: str
    run_dir: Path
    left: list[str]  # processes of the run alive the moment its launcher had exited


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[int, Finished]:
    """Both runs, started together and waited for, each looked at as soon as its launcher exits."""
    root = tmp_path_factory.mktemp("e2e")
    started = {eta: start_tandem(root, tiny_model_dir, eta) for eta in ETAS}
    done: dict[int, Finished] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while len(done) < len(started) and time.monotonic() < deadline:
            for eta, (process, run_dir) in started.items():
                if eta not in done and process.poll() is not None:
                    left = processes_of(run_dir)
                    out, err = (
                        (root / f"{run_dir.name}.stdout").read_text(),
                        (root / f"{run_dir.name}.stderr").read_text(),
                    )
                    done[eta] = Finished(process.returncode, out, err, run_dir, left)
            time.sleep(0.2)
    finally:
        for process, _ in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    assert len(done) == len(started), f"tandem run did not end within {RUN_TIMEOUT_S}s: eta {set(started) - set(done)}"
    return done


@pytest.mark.parametrize("eta", ETAS)
def test_tandem_run_end_to_end(runs: dict[int, Finished], eta: int) -> None:
    run = runs[eta]
    stdout, run_dir = run.stdout, run.run_dir
    assert run.code == 0, f"tandem run failed:\n{stdout[-3000:]}\n{run.stderr[-5000:]}"
    assert not run.left, f"processes of the run outlived the launcher: {run.left}"

    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, len(records) + 1)) and len(records) == STEPS
    for record in records:
        assert REQUIRED_KEYS <= record.keys(), REQUIRED_KEYS - record.keys()
        assert record["staleness/max"] <= eta
    assert records[-1]["policy_version"] == STEPS

    c = buffer_counters(run_dir)  # written by the buffer as it stops
    assert c["arrived"] == c["trained"] + c["dropped_stale"] + c["evicted"] + c["rejected"] + c["buffered"]
    assert c["served"] >= STEPS * 2 * 4  # steps x groups_per_step x group_size samples
    if eta == 0:
        assert c["dropped_stale"] == 0  # synchronous: admission alone keeps every sample fresh
    assert "run finished" in stdout and "tensorboard --logdir" in stdout
    assert (run_dir / "config.json").is_file() and any((run_dir / "tb").iterdir())
