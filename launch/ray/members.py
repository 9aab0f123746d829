"""Fleet members of `tandem ray`: one `RoleProcess` actor each, created in a placement slot, then watched, stopped
and killed by the controller (launch.ray.fleet), several at once.

    [member] = spawn("my-run", "generator", [3], [slot], cpus=1, gpus=0, run_dir=run_dir)   # placed, not started
    start([member], [["generator", "--generator.index", "3"]], [{}], config_text)  # the role runs, watched
    codes = exits([member], faults)            # {"generator-3": None | exit code | "actor died"}: no actor call
    stop([member], grace_s=10, faults, log)    # SIGTERM, grace, SIGKILL of its process group; the actor killed

Failure modes survived here (counted in `faults`, logged): an actor that died (its role got SIGTERM from
PR_SET_PDEATHSIG), an actor that does not confirm a stop in time (killed anyway).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch.local import last_meaningful_line
from launch.ray.placement import Slot
from launch.ray.plan import NAMESPACE, actor_name
from launch.ray.roles import CONCURRENCY, WATCH, RoleProcess

STOP_SLACK_S = 30.0  # beyond the grace period, how long a stop may take to be confirmed
CALL_TIMEOUT_S = 150.0  # placement of one actor, a role start, a wait until it listens
ACTOR_DIED = "actor died"


@dataclass
class Member:
    """One fleet member: its actor, its placement slot, where it runs and its index (rank, generator index)."""

    name: str  # "buffer-0", "learner-1", "generator-7"
    role: str  # "buffer", "learner", "generator"
    index: int
    actor: Any
    slot: Slot
    node: dict[str, str]
    pid: int | None = None
    exited: Any = None  # the ObjectRef of wait_exit(): resolves with the exit code, fails if the actor dies
    stopping: Any = None  # the ObjectRef of a stop() in progress (a retiring generator)

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "index": self.index,
            "node": self.node.get("ip"),
            "node_id": self.node.get("node_id"),
            "pid": self.pid,
            "retiring": self.stopping is not None,
        }


def spawn(
    run_name: str, role: str, indices: list[int], slots: list[Slot], cpus: float, gpus: float, run_dir: Path
) -> list[Member]:
    """Create one actor per index (named `tandem:<run>:<role>-<index>`) in its slot, all at once; returns once
    Ray has placed them all. Never restarted by Ray (max_restarts = 0): the controller decides what replaces one."""
    import ray

    actor_class = ray.remote(concurrency_groups=CONCURRENCY)(RoleProcess)
    actors = [
        actor_class.options(
            name=actor_name(run_name, f"{role}-{index}"),
            namespace=NAMESPACE,
            num_cpus=cpus,
            num_gpus=gpus,
            scheduling_strategy=slot.strategy(),
            max_restarts=0,
        ).remote(f"{role}-{index}", str(run_dir))
        for index, slot in zip(indices, slots)
    ]
    nodes = call([actor.node.remote() for actor in actors])
    return [
        Member(f"{role}-{index}", role, index, actor, slot, node)
        for index, slot, actor, node in zip(indices, slots, actors, nodes)
    ]


def call(refs: Any) -> Any:
    """ray.get with the timeout of one member operation (a hung actor raises GetTimeoutError, not a hang)."""
    import ray

    return ray.get(refs, timeout=CALL_TIMEOUT_S)


def start(members: list[Member], argv_tails: list[list[str]], envs: list[dict[str, str]], config_text: str) -> None:
    """Start every member's role at once (see RoleProcess.start) and begin watching each for its exit."""
    pids = call([m.actor.start.remote(argv, env, config_text) for m, argv, env in zip(members, argv_tails, envs)])
    for member, pid in zip(members, pids):
        member.pid = pid
        member.exited = member.actor.wait_exit.options(concurrency_group=WATCH).remote()


def exits(members: list[Member], faults: Counter) -> dict[str, Any]:
    """name -> None (running), its exit code, or ACTOR_DIED (counted in faults["actors_died"]). Looks only at
    the members' pending `wait_exit` refs: no call to any actor."""
    import ray
    from ray.exceptions import RayActorError

    refs = {member.exited: member for member in members}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
    codes: dict[str, Any] = {member.name: None for member in members}
    for ref in ready:
        try:
            codes[refs[ref].name] = ray.get(ref)
        except RayActorError:
            faults["actors_died"] += 1
            codes[refs[ref].name] = ACTOR_DIED
    return codes


def stop(members: list[Member], grace_s: float, faults: Counter, log: logging.Logger) -> None:
    """SIGTERM every member's role at once (unless a stop is already under way), wait up to `grace_s`, SIGKILL
    what is left, then kill the actors. A dead or hung actor is killed all the same (its role then gets SIGTERM
    from PR_SET_PDEATHSIG)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    refs = [m.stopping or m.actor.stop.remote(grace_s) for m in members]
    for member, ref in zip(members, refs):
        try:
            ray.get(ref, timeout=grace_s + STOP_SLACK_S)
        except RayActorError:
            pass  # gone already
        except GetTimeoutError:
            faults["stop_timeouts"] += 1
            log.warning("%s did not confirm its stop within %.0fs: killing its actor", member.name, grace_s)
        ray.kill(member.actor, no_restart=True)


def failure(member: Member, run_dir: Path, lines: int = 200) -> str:
    """Why the member ended, as `tandem run` says it: the last meaningful line of its output (the exception line
    of its last traceback, see launch.local.last_meaningful_line, read from its actor's last `lines` lines), then
    where its full log is (on the member's node). If the actor is gone, only where the log is."""
    from ray.exceptions import GetTimeoutError, RayActorError

    log_path = run_dir / "logs" / f"{member.name}.out"
    try:
        text = call(member.actor.tail.remote(lines))
    except (RayActorError, GetTimeoutError):
        return f"(actor gone)\n  full log: {log_path}"
    return f"{last_meaningful_line(text)}\n  full log: {log_path}"


def describe_code(code: Any) -> str:
    return code if isinstance(code, str) else f"exit code {code}"


def wait_name_released(run_name: str, member_name: str, timeout_s: float = 30.0) -> None:
    """`ray.kill` is asynchronous: wait until a killed member's actor name can be taken again."""
    import ray

    name = actor_name(run_name, member_name)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.2)
    raise RuntimeError(f"actor {name} still exists {timeout_s:.0f}s after it was killed")
