"""How `tandem run` ends a run (no processes): each role's stop grace comes from the config (a draining generator
is never killed before its drain timeout), the interrupt message gives the command that resumes the run, and the
summary of a resumed run counts this session apart from the whole run."""

from __future__ import annotations

import json
from pathlib import Path

from launch import local
from launch.progress import summarize
from launch.testing import run_config
from learners.checkpoint import STATE_FILE


def test_the_stop_grace_covers_each_role_s_own_timeout(tmp_path: Path) -> None:
    config = run_config(tmp_path, "grace", generator={"drain_timeout_s": 30.0}, learner={"stop_timeout_s": 90.0})
    assert local.stop_grace_s(config, "generator") == 30.0 + local.STOP_MARGIN_S
    assert local.stop_grace_s(config, "learner") == 90.0 + local.STOP_MARGIN_S
    assert local.stop_grace_s(config, "buffer") == local.STOP_MARGIN_S


def test_the_interrupt_message_says_what_resumes_and_how(tmp_path: Path) -> None:
    config = run_config(tmp_path, "stopped", learner={"total_steps": 9})
    config_path = config.run.run_dir / "config.json"
    assert "before any checkpoint" in local.interrupt_message(config, config_path)
    (config.run.run_dir / "checkpoints" / "step-000007").mkdir(parents=True)
    (config.run.run_dir / "checkpoints" / "step-000007" / STATE_FILE).write_text("{}")
    message = local.interrupt_message(config, config_path)
    assert "checkpoint of step 7/9" in message
    assert f"resume with: tandem run {config_path} --learner.resume true" in message


def _write_records(run_dir: Path, steps: range, samples: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "metrics.jsonl").open("a") as handle:
        for step in steps:
            record = {"step": step, "reward/mean": 0.5, "perf/samples": samples, "policy_version": step}
            handle.write(json.dumps(record) + "\n")


def test_the_summary_of_a_resumed_run_counts_this_session_and_the_run(tmp_path: Path) -> None:
    _write_records(tmp_path, range(1, 10), samples=8)  # 7 steps before the interrupt, 2 after the resume at 7
    fresh = summarize(tmp_path, wall_s=60)
    assert "run finished: 9 learner steps in 1.0 min\n" in fresh and "samples trained 72 " in fresh
    resumed = summarize(tmp_path, wall_s=60, first_step=7)
    assert "run finished: 2 learner steps in 1.0 min (resumed at step 7; the run: 9 steps, 72 samples trained)" in (
        resumed
    )
    assert "samples trained 16 this session" in resumed
