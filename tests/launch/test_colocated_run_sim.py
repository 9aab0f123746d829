"""run.placement = "colocated" end to end in SIMULATION: `tandem run` at η = 0 with every role pinned to every core
of this machine finishes, trains every step on samples of the current policy, and says where it put each role."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.metrics import read_metrics
from launch.local import cores_spec
from launch.testing import RoleUnderTest, run_config
from tests.launch.ray_runs import buffer_counters

pytestmark = pytest.mark.integration  # starts role processes

STEPS = 3
RUN_TIMEOUT_S = 120


def test_a_colocated_synchronous_run_finishes_with_every_core_to_each_role(tmp_path: Path) -> None:
    config = run_config(
        tmp_path,
        "colocated",
        run={"simulate": True, "placement": "colocated"},
        algo={"group_size": 2, "max_staleness": 0},
        env={"num_prompts": 32},
        learner={"total_steps": STEPS, "groups_per_step": 2, "sim_sample_s": 0.01, "sim_weights_mb": 1.0},
        generator={"sim_tokens": 4, "sim_token_s": 0.01, "prompts_in_flight": 2, "drain_timeout_s": 5},
    )
    launcher = RoleUnderTest(config, "run")
    with launcher:
        code = launcher.wait(RUN_TIMEOUT_S)
    assert code == 0, f"tandem run exited {code}:\n{launcher.tail(8000)}"
    every = cores_spec(os.sched_getaffinity(0))
    assert f"placement colocated: learner-0 cores {every}; generator-0 cores {every}" in launcher.output()
    records = read_metrics(config.run.run_dir / "metrics.jsonl")
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    assert max(record["staleness/max"] for record in records) == 0  # synchronous: what colocated is for
    counters = buffer_counters(config.run.run_dir)
    assert counters["trained_groups"] == STEPS * 2
