"""What `tandem ray` decides before and while it places a fleet: names, resources, endpoints, rank environments.

Pure functions of the config (and of what the cluster reported), so they are tested without Ray:

    demand = resource_demand(config)       # {"CPU": 3.0, "GPU": 0.0}: buffer + learners + generators (+ reward)
    problem = capacity_problem(demand, ray.cluster_resources(), generators=4, reward=config.reward_service)
    config = fleet_config(config, Endpoints("10.0.0.5", 41234, "10.0.0.7", 41801, "10.0.0.9", 41990))
    port = distinct_port(lambda: ray.get(actor.reserve_port.remote(host)), taken={41234, 41801})
    env = learner_env(rank=1, node_ids=["a", "a", "b"], master_addr="10.0.0.7", master_port=29500)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import TandemConfig, build_config

NAMESPACE = "tandem"  # the Ray namespace of every Tandem actor (names are unique within it)


def actor_name(run_name: str, member: str) -> str:
    """The Ray actor name of a fleet member, as the dashboard shows it: `tandem:<run>:generator-3`."""
    return f"{NAMESPACE}:{run_name}:{member}"


def controller_name(run_name: str) -> str:
    return actor_name(run_name, "controller")


def learner_processes(config: TandemConfig) -> int:
    """Learner processes (= Ray actors) to start: `learner.world_size` DeepSpeed ranks, or ONE in simulation,
    where a single process stands for all ranks (see learners/sim_trainer.py)."""
    return 1 if config.run.simulate else config.learner.world_size


def resource_demand(config: TandemConfig, generators: int | None = None) -> dict[str, float]:
    """CPUs and GPUs the fleet reserves: the buffer, each learner process, each generator, and the reward service
    when the run has one (`config.reward_service`: env.reward_model scored outside the generators)."""
    ray_config = config.ray
    count = config.generator.count if generators is None else generators
    ranks = learner_processes(config)
    reward = 1 if config.reward_service else 0
    return {
        "CPU": ray_config.buffer_cpus
        + ranks * ray_config.learner_cpus
        + count * ray_config.generator_cpus
        + reward * ray_config.reward_cpus,
        "GPU": ranks * ray_config.learner_gpus + count * ray_config.generator_gpus + reward * ray_config.reward_gpus,
    }


def capacity_problem(
    demand: dict[str, float], total: dict[str, Any], generators: int, reward: bool = False
) -> str | None:
    """None when the cluster's resources (`ray.cluster_resources()`) can hold the demand at all, else a message
    that says what to change (`reward`: the demand includes the reward service). (Resources held by other jobs
    show up later, as a placement timeout.)"""
    for resource, wanted in demand.items():
        have = float(total.get(resource, 0.0))
        if wanted > have + 1e-9:
            knob = resource.lower() + "s"
            fleet = f"{generators} generator(s)"
            members = f"the learner, {fleet} and the reward service" if reward else f"the learner and {fleet}"
            knobs = f"ray.learner_{knob}, ray.generator_{knob}" + (f", ray.reward_{knob}" if reward else "")
            return (
                f"the Ray cluster has {have:g} {resource} in all, but this run reserves {wanted:g} for the "
                f"buffer, {members}: lower ray.buffer_{knob}, {knobs} or the generator count, or add nodes"
            )
    return None


def distinct_port(reserve: Callable[[], int], taken: set[int], tries: int = 20) -> int:
    """A port from `reserve()` (a port free on some node now) that is none of `taken`: the other services' ports,
    which a second reservation may return again once they are released, and which the config refuses to share
    (`reward.port` must differ from buffer.port and learner.weights_port, whatever their hosts). RuntimeError if
    `tries` reservations all fell in `taken`."""
    for _ in range(tries):
        port = reserve()
        if port not in taken:
            return port
    raise RuntimeError(f"{tries} port reservations all returned one of {sorted(taken)}: the node's ports are exhausted")


@dataclass(frozen=True)
class Endpoints:
    """Where the services bind, as found at start: the buffer's node and port, learner rank 0's publisher, and the
    reward service's node and port (reward_port 0: the run has no reward service)."""

    buffer_host: str
    buffer_port: int
    weights_host: str
    weights_port: int
    reward_host: str = ""
    reward_port: int = 0

    @property
    def buffer_address(self) -> str:
        return f"{self.buffer_host}:{self.buffer_port}"  # split at the last ':', so IPv6 needs no brackets

    @property
    def weights_address(self) -> str:
        return f"{self.weights_host}:{self.weights_port}"

    @property
    def reward_address(self) -> str:
        return f"{self.reward_host}:{self.reward_port}"


def fleet_config(config: TandemConfig, endpoints: Endpoints) -> TandemConfig:
    """The config every role of the fleet reads (written as `<run_dir>/config.json`): the discovered endpoints
    filled in on both sides (the reward service's too, when `endpoints.reward_port` is set: reward.host/port where
    it binds, reward.address where the generators reach it), the run root made absolute (roles run in other
    working directories, maybe other machines), and no core pinning (Ray's reservations place the roles).
    Validated like any config."""
    data = config.model_dump(mode="json")
    data["run"]["root"] = str(Path(config.run.root).resolve())
    data["buffer"].update(host=endpoints.buffer_host, port=endpoints.buffer_port)
    data["learner"].update(
        buffer_address=endpoints.buffer_address,
        weights_host=endpoints.weights_host,
        weights_port=endpoints.weights_port,
        cpu_cores="",
    )
    data["generator"].update(
        buffer_address=endpoints.buffer_address, weights_address=endpoints.weights_address, cpu_cores=""
    )
    if endpoints.reward_port:
        data["reward"].update(
            host=endpoints.reward_host, port=endpoints.reward_port, address=endpoints.reward_address, cpu_cores=""
        )
    return build_config(data)


def learner_env(
    rank: int, node_ids: list[str], master_addr: str, master_port: int, own_device: bool = False
) -> dict[str, str]:
    """torchrun's environment for learner `rank` of `len(node_ids)` (node_ids[r] = the Ray node of rank r):
    RANK, WORLD_SIZE, LOCAL_RANK (its position among the ranks on its node), LOCAL_WORLD_SIZE, MASTER_*.

    own_device: Ray gives each rank only its own GPU (CUDA_VISIBLE_DEVICES), which it sees as device 0, so
    LOCAL_RANK is 0 and LOCAL_WORLD_SIZE 1 (device = cuda:LOCAL_RANK stays right)."""
    node = node_ids[rank]
    local_ranks = [r for r, n in enumerate(node_ids) if n == node]
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(len(node_ids)),
        "LOCAL_RANK": "0" if own_device else str(local_ranks.index(rank)),
        "LOCAL_WORLD_SIZE": "1" if own_device else str(len(local_ranks)),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def bind_problem(host: str, config: TandemConfig) -> str | None:
    """None when roles may bind `host`; else why not: a non-loopback address needs CurveZMQ keys or insecure."""
    from common.sockets import is_loopback

    if is_loopback(host) or config.run.curve_keys_dir is not None or config.run.insecure:
        return None
    return (
        f"on a Ray cluster the buffer, the weight publisher and the reward service bind their node's address "
        f"({host}): set run.curve_keys_dir (CurveZMQ keys, present on every node) or run.insecure = true on a "
        "trusted network"
    )
