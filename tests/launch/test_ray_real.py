"""`tandem ray` with the real engines: the tiny model, vLLM generator and DeepSpeed learner as Ray actors on a
3-node cluster (one machine), a few steps. Slow start (~1 min: vLLM and DeepSpeed warm up on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.metrics import read_metrics
from tests.launch.ray_runs import RayLaunch, buffer_counters, processes_of

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.deepspeed, pytest.mark.timeout(400)]

E2E_CONFIG = Path(__file__).resolve().parent / "e2e.toml"
STEPS = 3


def test_tiny_model_trains_through_tandem_ray(
    tmp_path: Path, ray_cluster: str, curve_keys: Path, tiny_model_dir: Path
) -> None:
    launch = RayLaunch(
        tmp_path,
        "real",
        ray_cluster,
        curve_keys,
        E2E_CONFIG,
        "--model.path",
        str(tiny_model_dir),
        "--learner.total_steps",
        str(STEPS),
        "--ray.buffer_cpus",
        "0.5",
        "--ray.learner_cpus",
        "1",
        "--ray.generator_cpus",
        "1",
    )
    try:
        assert launch.wait_exit(timeout_s=360) == 0, launch.tail()
    finally:
        launch.close()
    records = read_metrics(launch.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {"loss/policy", "policy/kl", "reward/mean", "staleness/max"} <= records[-1].keys()
    assert records[-1]["policy_version"] == STEPS
    counters = buffer_counters(launch.run_dir)
    assert counters["arrived"] == (
        counters["trained"]
        + counters["dropped_stale"]
        + counters["evicted"]
        + counters["rejected"]
        + counters["buffered"]
    )
    assert "run finished" in launch.tail()
    assert not processes_of(launch.run_dir), processes_of(launch.run_dir)
