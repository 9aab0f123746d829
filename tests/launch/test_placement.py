"""run.placement (launch/local.py): "split" halves the cores between generators and learner; "colocated" gives
each role every core, only with synchronous training, and only under `tandem run`."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import ConfigError
from launch import local
from launch.ray import launcher as ray_launch
from launch.testing import run_config

FOUR = {0, 1, 2, 3}


def _config(tmp_path: Path, placement: str = "colocated", eta: int = 0, **sections: dict[str, object]):
    run = {"placement": placement, **sections.pop("run", {})}
    return run_config(tmp_path / "runs", "p", run=run, algo={"max_staleness": eta}, **sections)


@pytest.fixture
def four_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local.os, "sched_getaffinity", lambda pid: FOUR)


def test_colocated_is_refused_when_training_is_asynchronous(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:
        _config(tmp_path, eta=2)
    message = str(error.value)
    assert 'run.placement: "colocated"' in message
    assert "set algo.max_staleness = 0 (got 2)" in message
    assert 'run.placement = "split"' in message
    assert _config(tmp_path, placement="split", eta=2).run.placement == "split"
    with pytest.raises(ConfigError, match="run.placement"):
        _config(tmp_path, placement="shared")


def test_split_stays_the_default_halves(tmp_path: Path, four_cores: None) -> None:
    config = run_config(tmp_path / "runs", "p")
    assert config.run.placement == "split"
    assert local.plan_cores(config) == ({0, 1}, {2, 3})


def test_colocated_gives_every_core_to_each_role(tmp_path: Path, four_cores: None) -> None:
    config = _config(tmp_path)
    assert local.plan_cores(config) == (FOUR, FOUR)
    roles = {role.name: role for role in local.build_roles(config, tmp_path / "config.json")}
    assert roles["buffer-0"].cores is None
    assert roles["learner-0"].cores == roles["generator-0"].cores == FOUR
    # the cores reach the roles as their own cpu_cores: vLLM binds one OpenMP thread to each, torch sizes its pool
    assert roles["learner-0"].argv[-2:] == ["--learner.cpu_cores", '"0,1,2,3"']
    assert roles["generator-0"].argv[-2:] == ["--generator.cpu_cores", '"0,1,2,3"']


def test_explicit_cores_win_over_colocated(tmp_path: Path, four_cores: None) -> None:
    assert local.plan_cores(_config(tmp_path, learner={"cpu_cores": "3"})) == (FOUR, {3})
    assert local.plan_cores(_config(tmp_path, generator={"cpu_cores": "0-1"})) == ({0, 1}, FOUR)


def test_colocated_reward_service_gets_every_core_too(tmp_path: Path, four_cores: None) -> None:
    reward_model = {"reward_model": str(tmp_path / "rm")}
    config = _config(tmp_path, env=reward_model)
    assert local.plan_reward_cores(config, FOUR) == (FOUR, FOUR)  # split would take core 3 from the generators
    assert local.plan_reward_cores(_config(tmp_path, env=reward_model, reward={"cpu_cores": "2"}), FOUR) == (
        {2},
        FOUR,
    )
    roles = {role.name: role for role in local.build_roles(config, tmp_path / "config.json")}
    assert roles["reward-0"].cores == roles["generator-0"].cores == roles["learner-0"].cores == FOUR


def test_an_inherited_spinning_wait_policy_is_warned_about_when_colocated() -> None:
    assert local.spin_warning("colocated", {}) is None  # libgomp's default sleeps after a short spin
    assert local.spin_warning("colocated", {"OMP_WAIT_POLICY": "PASSIVE"}) is None
    assert local.spin_warning("split", {"OMP_WAIT_POLICY": "ACTIVE"}) is None  # each role has cores of its own
    warning = local.spin_warning("colocated", {"OMP_WAIT_POLICY": "active"})
    assert warning is not None and warning.startswith("run.placement colocated with OMP_WAIT_POLICY=active in")
    assert warning.endswith("unset it")
    both = local.spin_warning("colocated", {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "infinity"})
    assert both is not None and "OMP_WAIT_POLICY=ACTIVE and GOMP_SPINCOUNT=infinity" in both
    assert both.endswith("unset them")


def test_tandem_ray_refuses_colocated_before_ray_starts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert ray_launch.run(_config(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.startswith('tandem ray: run.placement: "colocated" is a `tandem run` placement')
    assert "leave run.placement out" in err
    assert not (tmp_path / "runs" / "p").exists()
