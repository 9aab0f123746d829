"""Say why when nothing moves (issue 30), end to end in SIMULATION: a generator so slow that the learner waits past
learner.wait_report_s for its first batch. The learner explains the wait in one line (generation rate, what a batch
needs, what to change) in its log and in waiting.jsonl, and `tandem run` prints it above its progress bar."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.metrics import read_metrics
from launch.testing import RoleUnderTest, run_config

pytestmark = pytest.mark.integration  # starts role processes

SIM_TOKENS, STEP_S = 14, 1.5  # one sample takes 21 s; the learner's buffer link asks again every 5 s


def test_a_long_wait_for_the_first_batch_is_explained_in_one_line(tmp_path: Path) -> None:
    config = run_config(
        tmp_path,
        "stalled",
        run={"simulate": True},
        algo={"group_size": 2, "max_staleness": 1},
        env={"num_prompts": 8},
        learner={
            "total_steps": 1,
            "groups_per_step": 2,
            "sim_sample_s": 0.01,
            "sim_weights_mb": 1.0,
            "wait_report_s": 12.0,
        },
        generator={"sim_tokens": SIM_TOKENS, "sim_token_s": STEP_S, "prompts_in_flight": 2, "drain_timeout_s": 5},
    )
    launcher = RoleUnderTest(config, "run")
    with launcher:
        code = launcher.wait(60)
    assert code == 0, f"tandem run exited {code}:\n{launcher.tail(8000)}"
    run_dir = config.run.run_dir
    [first, *_] = read_metrics(run_dir / "waiting.jsonl")
    line = first["message"]
    assert first["step"] == 0 and first["learner/waiting_for_batch_s"] >= 12.0, first
    assert line.startswith("no batch for step 0 after ") and "1 generator alive" in line, line
    assert "tok/s (1 generator alive); one batch needs 4 samples (2 groups x 2)" in line, line
    assert "Change: to generate a batch faster:" in line and "generator.count = 1" in line, line
    learner_log = "".join(p.read_text() for p in (run_dir / "logs").glob("learner-0*"))
    assert line in learner_log
    assert f"learner: {line[:60]}" in launcher.output().replace("\n", " "), launcher.tail(4000)
    assert [record["step"] for record in read_metrics(run_dir / "metrics.jsonl")] == [1]
