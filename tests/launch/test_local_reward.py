"""`tandem run` with a reward service (launch/local.py): the role, its place in the start order, its cores."""

from __future__ import annotations

from pathlib import Path

from launch import local
from launch.testing import run_config


def _config(tmp_path: Path, **reward: object):
    return run_config(tmp_path / "runs", "rm", env={"reward_model": str(tmp_path / "rm")}, reward=reward)


def test_the_reward_service_starts_after_the_learner_and_before_the_generators(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(local.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    roles = local.build_roles(_config(tmp_path), tmp_path / "config.json")
    assert [role.name for role in roles] == ["buffer-0", "learner-0", "reward-0", "generator-0"]
    reward, generator = roles[2], roles[3]
    assert reward.argv[3:5] == ["reward", str(tmp_path / "config.json")]
    assert (reward.cores, generator.cores, roles[1].cores) == ({1}, {0}, {2, 3})  # its own core, from the generators'
    assert reward.argv[-2:] == ["--reward.cpu_cores", '"1"']
    in_process = run_config(tmp_path / "runs", "ip", env={"reward_model": "x"}, reward={"in_process": True})
    assert "reward-0" not in [role.name for role in local.build_roles(in_process, tmp_path / "config.json")]


def test_on_two_cores_the_reward_service_shares_the_generators_core(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(local.os, "sched_getaffinity", lambda pid: {0, 1})
    assert local.plan_reward_cores(_config(tmp_path), {0}) == ({0}, {0})
    assert local.plan_reward_cores(_config(tmp_path, cpu_cores="3"), {0, 1}) == ({3}, {0, 1})  # written: wins


class _Exited:
    def __init__(self, code: int | None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


def test_a_reward_service_that_exits_fails_the_run_whatever_its_code(tmp_path: Path):
    roles = [local.Role(name, [], None) for name in ("buffer-0", "learner-0", "reward-0", "generator-0")]
    for role, code in zip(roles, (None, None, 0, None)):
        role.process = _Exited(code)  # type: ignore[assignment]

    class _Progress:
        def refresh(self) -> None:
            pass

    assert local.supervise(roles, _Progress(), [], learner_grace_s=1.0) is roles[2]
