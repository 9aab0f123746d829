"""A run directory that holds a run is refused without learner.resume (two runs never share one metrics.jsonl),
by `tandem run` and `tandem ray` (any record) and by a learner started alone (its own records); before anything
starts, in one line that says what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.run_dir import reuse_problem
from launch import local
from launch.testing import run_config


def test_a_fresh_or_config_only_directory_is_accepted(tmp_path: Path) -> None:
    assert reuse_problem(tmp_path / "new", resume=False, whole_run=True) is None
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "config.json").write_text("{}")  # what a harness writes before it starts the launcher
    (tmp_path / "new" / "logs").mkdir()
    (tmp_path / "new" / "logs" / "buffer-0.log").write_text("a failed start\n")
    assert reuse_problem(tmp_path / "new", resume=False, whole_run=True) is None


@pytest.mark.parametrize(
    ("record", "whole_run", "refused"),
    [
        ("metrics.jsonl", True, True),
        ("metrics.jsonl", False, True),
        ("checkpoints/step-000002/learner_state.json", False, True),
        ("buffer.jsonl", True, True),
        ("buffer.jsonl", False, False),  # a learner alone: the buffer of its run may have started first
        ("tb/events.out.tfevents.1", True, True),
    ],
)
def test_a_directory_holding_a_run_is_refused_unless_resumed(
    tmp_path: Path, record: str, whole_run: bool, refused: bool
) -> None:
    path = tmp_path / "run" / record
    path.parent.mkdir(parents=True)
    path.write_text('{"step": 1}\n')
    problem = reuse_problem(tmp_path / "run", resume=False, whole_run=whole_run)
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith(f"run.name: {tmp_path / 'run'} already holds a run ({record.split('/')[0]}")
        assert "--learner.resume true" in problem and "--run.name" in problem and "aside" in problem
        assert "\n" not in problem
    assert reuse_problem(tmp_path / "run", resume=True, whole_run=whole_run) is None


def test_tandem_run_refuses_before_any_role_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = run_config(tmp_path, "used", run={"simulate": True})
    config.run.run_dir.mkdir(parents=True)
    (config.run.run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    assert local.run(config) == 2  # returns before any Popen (this unit test may start none)
    assert "already holds a run (metrics.jsonl)" in capsys.readouterr().err
    assert sorted(p.name for p in config.run.run_dir.iterdir()) == ["metrics.jsonl"]  # nothing written


def test_a_learner_alone_refuses_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from learners import learner

    # A learner started by hand has no RANK (torchrun's ranks do, and were checked by what started them). An
    # in-process DeepSpeed test earlier in the session leaves RANK=0 in os.environ (learners.engine.init_distributed),
    # which would skip the check and leave this learner waiting for a buffer that never comes.
    for variable in local.RENDEZVOUS_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    config = run_config(tmp_path, "used", run={"simulate": True})
    (config.run.run_dir / "checkpoints" / "step-000001").mkdir(parents=True)
    assert learner.run(config) == 2
    assert "already holds a run (checkpoints)" in capsys.readouterr().err
