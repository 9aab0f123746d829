"""The reward service as a `tandem ray` member, without a cluster: the controller (launch.ray.fleet) driven with fake
actors, slots and member operations, to check which members it places with which resources, which addresses it
writes for the generators, and how it restarts a dead reward service (same slot, same port, within its budget).
The real placement and processes are covered by the Ray tests (tests/launch/test_ray_fleet.py) and, for the
reward role itself, by tests/actors."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from common.config import load_config
from launch.ray import fleet as ray_fleet
from launch.ray.fleet import FleetController, RunEnded
from launch.ray.members import Member


class Method:
    """`actor.method.remote(...)` of a fake actor: the answer at once (the controller's `call` is the identity)."""

    def __init__(self, answer: Callable[..., Any]) -> None:
        self.answer = answer

    def remote(self, *args: Any) -> Any:
        return self.answer(*args)


class FakeActor:
    def __init__(self, ports: Iterator[int], port_free: bool = True) -> None:
        self.reserve_port = Method(lambda host: next(ports))
        self.wait_port_free = Method(lambda host, port, timeout_s: port_free)


class FakePool:
    def __init__(self, label: str) -> None:
        self.label = label
        self.released: list[str] = []

    def acquire(self, count: int) -> list[str]:
        return [f"{self.label}-slot-{i}" for i in range(count)]

    def release(self, slot: str) -> None:
        self.released.append(slot)


class RecordingSink:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.records: list[dict[str, Any]] = []

    def log(self, step: int, values: dict[str, Any]) -> None:
        self.records.append(values)


class FakeMembers:
    """Stands in for launch.ray.members: records what the controller spawns, starts and stops."""

    def __init__(self, ips: dict[str, str], ports: list[int]) -> None:
        self.ips = ips  # role -> node IP its actor lands on
        self.ports = iter(ports)
        self.spawned: list[dict[str, Any]] = []
        self.started: list[tuple[str, list[str]]] = []
        self.stopped: list[str] = []

    def spawn(self, run_name, role, indices, slots, cpus, gpus, run_dir) -> list[Member]:
        self.spawned.append({"role": role, "indices": indices, "slots": slots, "cpus": cpus, "gpus": gpus})
        return [
            Member(f"{role}-{i}", role, i, FakeActor(self.ports), slot, {"ip": self.ips[role], "node_id": role})
            for i, slot in zip(indices, slots)
        ]

    def start(self, started: list[Member], argv_tails, envs, config_text) -> None:
        for member, argv in zip(started, argv_tails):
            member.pid = 100 + len(self.started)
            self.started.append((member.name, argv))

    def stop(self, stopping: list[Member], grace_s, faults, log) -> None:
        self.stopped += [m.name for m in stopping]


def controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: FakeMembers, local: bool, **overrides: Any
) -> FleetController:
    monkeypatch.setattr(ray_fleet, "setup_logging", lambda *a, **k: logging.getLogger("tandem.test"))
    monkeypatch.setattr(ray_fleet, "MetricsSink", RecordingSink)
    monkeypatch.setattr(ray_fleet, "call", lambda refs: refs)
    for name in ("spawn", "start", "stop"):
        monkeypatch.setattr(ray_fleet.members, name, getattr(fake, name))
    monkeypatch.setattr(ray_fleet.members, "failure", lambda member, run_dir: "RuntimeError: boom")
    config = load_config(
        None,
        {
            "run.root": str(tmp_path),
            "run.insecure": True,
            "env.reward_model": str(tmp_path / "rm"),
            "ray.reward_cpus": 2,
            "ray.reward_gpus": 1,
            **overrides,
        },
    )
    fleet = FleetController(config.model_dump(mode="json"), local_cluster=local)
    fleet.pools = {role: FakePool(role) for role in fleet.pools}
    return fleet


def place(fleet: FleetController) -> None:
    """What _start_fleet does up to the config written: placement, ports, the fleet config."""
    endpoints, _ = fleet._place_services()
    fleet.config = ray_fleet.fleet_config(fleet.base, endpoints)
    fleet.config_text = fleet.config.model_dump_json()


def test_the_reward_service_is_placed_with_its_reservation_and_its_node_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ips = {"buffer": "10.0.0.5", "reward": "10.0.0.9", "learner": "10.0.0.7"}
    # the reward actor's first reservation returns the buffer's port again (released meanwhile): it must ask again
    fake = FakeMembers(ips, ports=[41234, 41801, 29500, 41234, 41990])
    fleet = controller(tmp_path, monkeypatch, fake, local=False)
    place(fleet)
    roles = [(s["role"], s["cpus"], s["gpus"]) for s in fake.spawned]
    assert roles == [("buffer", 1.0, 0.0), ("reward", 2.0, 1.0), ("learner", 1.0, 0.0)]
    assert fake.spawned[1]["slots"] == ["reward-slot-0"]  # a placement group of its own
    assert (fleet.config.reward.host, fleet.config.reward.port) == ("10.0.0.9", 41990)  # its node, a fresh port
    assert fleet.config.reward.address == "10.0.0.9:41990"  # what the generators read from config.json
    assert fleet.config.generator.buffer_address == "10.0.0.5:41234"
    status = fleet.status()
    assert status["reward_address"] == "10.0.0.9:41990" and status["reward"]["name"] == "reward-0"


def test_no_reward_member_without_a_reward_service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeMembers({"buffer": "10.0.0.5", "learner": "10.0.0.7"}, ports=[41234, 41801, 29500])
    fleet = controller(tmp_path, monkeypatch, fake, local=True, **{"reward.in_process": True})
    place(fleet)
    assert [s["role"] for s in fake.spawned] == ["buffer", "learner"]
    assert fleet.status()["reward"] is None and fleet.status()["reward_address"] is None


def test_on_a_local_ray_the_reward_service_binds_loopback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ips = {"buffer": "10.0.0.5", "reward": "10.0.0.5", "learner": "10.0.0.5"}
    fleet = controller(tmp_path, monkeypatch, FakeMembers(ips, ports=[41234, 41801, 29500, 41990]), local=True)
    place(fleet)
    assert fleet.config.reward.address == "127.0.0.1:41990"


def test_a_dead_reward_service_restarts_in_its_slot_on_its_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ips = {"buffer": "10.0.0.5", "reward": "10.0.0.9", "learner": "10.0.0.7"}
    fake = FakeMembers(ips, ports=[41234, 41801, 29500, 41990])
    fleet = controller(tmp_path, monkeypatch, fake, local=False, **{"ray.max_reward_restarts": 2})
    place(fleet)
    address = fleet.config.reward.address
    fleet._restart_reward("actor died")
    assert fake.stopped == ["reward-0"] and fleet.pools["reward"].released == []  # its slot kept, not freed
    assert fake.spawned[-1] == {"role": "reward", "indices": [1], "slots": ["reward-slot-0"], "cpus": 2.0, "gpus": 1.0}
    assert fake.started[-1] == ("reward-1", ["reward"])  # the same config.json: the same port, nothing re-announced
    assert fleet.config.reward.address == address and fleet.status()["restarts"]["reward"] == 1
    assert fleet.metrics.records[-1]["ray/reward_restarts"] == 1
    fleet._restart_reward(-9)
    with pytest.raises(RunEnded, match="ray.max_reward_restarts = 2 restarts are used up") as ended:
        fleet._restart_reward(1)
    assert ended.value.code == 1


def test_a_reward_slot_moved_to_another_node_ends_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ips = {"buffer": "10.0.0.5", "reward": "10.0.0.9", "learner": "10.0.0.7"}
    fake = FakeMembers(ips, ports=[41234, 41801, 29500, 41990])
    fleet = controller(tmp_path, monkeypatch, fake, local=False)
    place(fleet)
    fake.ips["reward"] = "10.0.0.11"  # Ray re-placed the bundle of a lost node
    with pytest.raises(RunEnded, match="moved from node 10.0.0.9 to 10.0.0.11"):
        fleet._restart_reward("actor died")
    assert [name for name, _ in fake.started] == []  # never started where the generators cannot reach it
