"""launch/gpu_plan.py and `tandem run`'s use of it: which GPUs each role sees (review finding 3), without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch import local
from launch.gpu_plan import gpu_problem, plan_gpus, visible_gpus
from launch.testing import run_config


def _config(tmp_path: Path, reward: bool = True, **sections: dict):
    env = {"reward_model": str(tmp_path / "rm")} if reward else {}
    return run_config(tmp_path / "runs", "gpus", env=env, **sections)


def _visible(roles: list[local.Role]) -> dict[str, str | None]:
    return {role.name: role.env.get("CUDA_VISIBLE_DEVICES") for role in roles}


def test_each_role_gets_its_own_gpus_in_order(tmp_path: Path) -> None:
    config = _config(tmp_path, generator={"count": 2})
    roles = local.build_roles(config, tmp_path / "config.json", plan_gpus(config, ["0", "1", "2", "3"]))
    assert _visible(roles) == {
        "buffer-0": "",
        "learner-0": "0",
        "reward-0": "3",
        "generator-0": "1",
        "generator-1": "2",
    }
    assert gpu_problem(config, ["0", "1", "2", "3"]) is None
    wide = _config(tmp_path, reward=False, learner={"world_size": 2}, generator={"tensor_parallel_size": 2})
    plan = plan_gpus(wide, ["4", "5", "6", "7"])  # the launcher's own CUDA_VISIBLE_DEVICES names
    assert plan is not None and not plan.shared
    assert (plan.env("learner-0"), plan.env("generator-0")) == (
        {"CUDA_VISIBLE_DEVICES": "4,5"},
        {"CUDA_VISIBLE_DEVICES": "6,7"},
    )


def test_without_gpus_no_role_s_environment_changes(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert plan_gpus(config, []) is None and gpu_problem(config, []) is None
    assert all(not role.env for role in local.build_roles(config, tmp_path / "config.json", plan_gpus(config, [])))
    simulated = _config(tmp_path, run={"simulate": True})
    assert plan_gpus(simulated, ["0"]) is None and gpu_problem(simulated, ["0"]) is None


def test_too_few_gpus_are_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, generator={"count": 2})
    assert gpu_problem(config, ["0", "1"]) == (
        "needs 4 GPUs (learner 1, 2 generators x TP 1, reward 1), this machine has 2: lower generator.count, "
        "generator.tensor_parallel_size or learner.world_size, or set run.share_gpus = true to share them"
    )
    monkeypatch.setattr(local, "visible_gpus", lambda: ["0", "1"])
    monkeypatch.setattr(local.Role, "start", lambda role, run_dir: pytest.fail(f"{role.name} started"))
    assert local.run(config) == 2
    assert "needs 4 GPUs" in capsys.readouterr().err
    assert not (config.run.run_dir / "config.json").exists()


def test_sharing_on_purpose_puts_every_role_on_one_gpu_with_room_for_the_learner(tmp_path: Path) -> None:
    config = _config(tmp_path, run={"share_gpus": True})
    problem = gpu_problem(config, ["0"])
    assert problem is not None and "set generator.gpu_memory_utilization = 0.5 or lower" in problem
    shared = _config(tmp_path, run={"share_gpus": True}, generator={"count": 2, "gpu_memory_utilization": 0.25})
    plan = plan_gpus(shared, ["0"])
    assert gpu_problem(shared, ["0"]) is None and plan is not None and plan.shared
    assert set(plan.devices.values()) == {("0",)}
    two = _config(
        tmp_path, reward=False, run={"share_gpus": True}, generator={"count": 3, "gpu_memory_utilization": 0.4}
    )
    assert plan_gpus(two, ["0", "1"]).devices == {  # type: ignore[union-attr]
        "learner-0": ("0",),
        "generator-0": ("1",),
        "generator-1": ("0",),
        "generator-2": ("1",),  # two engines share GPU 1: 0.8 of it
    }
    assert "2 vLLM engine(s) on a shared GPU" in (gpu_problem(two, ["0", "1"]) or "")
    ranks = _config(tmp_path, reward=False, run={"share_gpus": True}, learner={"world_size": 2})
    assert "learner.world_size = 2 needs 2 distinct GPUs" in (gpu_problem(ranks, ["0"]) or "")


def test_visible_gpus_honour_cuda_visible_devices_else_count_them(monkeypatch: pytest.MonkeyPatch) -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,1"}) == ["0"]  # CUDA ignores what follows an invalid entry
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert visible_gpus({}) == ["0", "1", "2"]
