"""The fleet controller of one run on a Ray cluster: the named, detached actor `tandem:<run>:controller` that
places, starts, watches, scales and stops the roles (each one a `RoleProcess` actor running the role as a child).

    controller = ray.remote(FleetController).options(name="tandem:<run>:controller", lifetime="detached",
                                                     max_concurrency=8, namespace="tandem").remote(config, local)
    ray.get(controller.start.remote())               # buffer -> reward -> learner rank(s) -> generators; status()
    ray.get(controller.scale_generators.remote(5))    # add or retire generators while the learner trains
    ray.get(controller.wait.remote(1.0))              # None while the run goes on, then {"outcome", "code"}
    ray.get(controller.stop.remote("interrupted"))    # generators, learners, reward + buffer: SIGTERM, grace, SIGKILL

Start order and endpoint discovery: the buffer's actor is placed and reserves a free port on its node; so does
the reward service's (`config.reward_service`: env.reward_model scored outside the generators; its own placement
group of one `ray.reward_cpus`/`ray.reward_gpus` bundle); the learner ranks are placed (one placement group,
PACK) and rank 0 reserves the weight publisher's port (and MASTER_PORT for DeepSpeed); those endpoints are
written into `<run_dir>/config.json`, which every role reads (the generators' reward.address among them); then
the buffer starts (and is waited for until it listens), the reward service starts, the learner ranks start with
torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) while it loads its model, and once it
listens (within REWARD_START_S) the generators start (placement groups, SPREAD): no group is scored with the
fallback because the service was not up yet. Roles bind loopback on a local Ray started by `tandem ray`, their
node's IP on a joined cluster.

Supervision (a thread, every SUPERVISE_S, under the lock that scaling also takes; it calls no actor while all is
well: each member's pending `wait_exit` ref resolves when its role exits or its actor dies):
  - every learner rank exited 0      -> the run finished: everything is stopped (generators first), code 0
                                        (the learner's final report has already told the buffer and the
                                        generators: they exit 0 by themselves, usually before);
  - a learner rank exits non-zero, or its actor dies -> every rank and generator is stopped; then either the
    run ends (code 1; the latest complete checkpoint stays resumable) or, within `ray.max_learner_restarts`,
    it restarts in place: a fresh buffer, the ranks with `--learner.resume true`, new generators;
  - the buffer exits 0               -> the run is over (the learner's final report came): the learner ranks are
                                        given `learner.stop_timeout_s` (+ margin) to save and exit 0, then code 1;
  - the buffer exits otherwise or dies -> the run ends, code 1;
  - the reward service exits or dies -> restarted in the same slot (same node) on the SAME port, within
    `ray.max_reward_restarts`: the generators' reward.address stays right, so nothing is re-announced; they
    score with env.failure_reward meanwhile (counted) and reconnect by themselves. Not waited for: a
    replacement that cannot bind (its port taken meanwhile) exits, and that is one more restart. If its slot
    was moved to another node (the node was lost) the address would change: the run ends, code 1, saying so;
  - the learner restarts from a checkpoint -> the reward service keeps running (it holds no run state);
  - a generator exits 0              -> it ran out of prompts or heard the run is over: done, not replaced;
  - a generator exits otherwise, or its actor dies -> replaced in the same slot (same node) by a generator
    with a NEW index, within `ray.max_generator_restarts`. A new index, because the buffer tracks liveness
    per generator id: the dead one's leases are then re-issued after `buffer.heartbeat_timeout_s` instead of
    waiting for `buffer.lease_timeout_s`. The new generator fetches the newest weights before its first lease.
Retired generators (scale down) get SIGTERM: they finish or return their leases, then their actors go. Every stop
gives a role its grace (`launch.local.stop_grace_s`: the generators' drain timeout, the learner's stop timeout);
the reward service stops after the generators (which score through it while they drain), with the buffer.
Counters go to `<run_dir>/ray.jsonl` (`ray/…`), the log to `<run_dir>/logs/controller-0.log`.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import Counter
from typing import Any

from common.config import TandemConfig, build_config, write_resolved
from common.logs import setup_logging
from common.metrics import MetricsSink
from common.trackers import Trackers
from launch.local import stop_grace_s
from launch.ray import members
from launch.ray.members import Member, call, describe_code
from launch.ray.placement import BundlePool, PlacementError, Slot
from launch.ray.plan import Endpoints, bind_problem, distinct_port, fleet_config, learner_env, learner_processes

SUPERVISE_S = 0.5
REWARD_START_S = 600.0  # the reward service loads its model before it listens (a large one from a network disk)
REPORT_EVERY = 20  # supervision passes between two `ray/…` records (and at every change of the fleet)
LOOPBACK = "127.0.0.1"


class RunEnded(Exception):
    """Raised inside the controller to end the run with an outcome (message) and an exit code."""

    def __init__(self, outcome: str, code: int) -> None:
        super().__init__(outcome)
        self.outcome, self.code = outcome, code


class FleetController:
    """See the module docstring. Public methods are Ray actor methods; every one takes `self.lock`."""

    def __init__(self, config_data: dict[str, Any], local_cluster: bool) -> None:
        self.base = build_config(config_data)
        self.run_name = self.base.run.name
        self.run_dir = self.base.run.run_dir
        self.local_cluster = local_cluster
        self.log = setup_logging("controller", 0, self.run_dir, simulation=self.base.run.simulate)
        self.metrics = MetricsSink(
            self.run_dir, "ray", simulation=self.base.run.simulate, trackers=Trackers.from_config(self.base)
        )
        self.lock = threading.RLock()
        self.ended = threading.Event()
        self.outcome: dict[str, Any] | None = None
        self.config: TandemConfig = self.base
        self.config_text = ""
        self.buffer: Member | None = None
        self.reward: Member | None = None  # the reward service, when config.reward_service
        self.next_reward_index = 0
        self.learners: list[Member] = []
        self.generators: list[Member] = []
        self.retiring: list[Member] = []
        self.next_generator_index = 0
        self.restarts = {"generator": 0, "learner": 0, "reward": 0}
        self.faults: Counter[str] = Counter()  # actors_died, stop_timeouts
        ray_config = self.base.ray
        timeout = ray_config.placement_timeout_s
        self.pools = {
            "buffer": BundlePool(self.run_name, "buffer", {"CPU": ray_config.buffer_cpus}, "PACK", timeout),
            "learner": BundlePool(
                self.run_name,
                "learner",
                {"CPU": ray_config.learner_cpus, "GPU": ray_config.learner_gpus},
                "PACK",
                timeout,
            ),
            "generator": BundlePool(
                self.run_name,
                "generator",
                {"CPU": ray_config.generator_cpus, "GPU": ray_config.generator_gpus},
                "SPREAD",
                timeout,
            ),
            "reward": BundlePool(
                self.run_name,
                "reward",
                {"CPU": ray_config.reward_cpus, "GPU": ray_config.reward_gpus},
                "PACK",
                timeout,
            ),
        }
        self.ticks = 0
        self.last_followed = 0.0
        self.buffer_gone_at: float | None = None  # when the buffer exited 0 (the run is over)
        self.learner_failed = False  # a learner rank failed: the others cannot checkpoint when stopped

    # ------------------------------------------------------------------------------------------ public API
    def start(self) -> dict[str, Any]:
        """Place and start the buffer, the reward service (if any), the learner rank(s) and `generator.count`
        generators, then supervise.
        Returns status(); if the fleet could not start, everything is stopped and status() has the outcome."""
        with self.lock:
            try:
                self._start_fleet()
            except RunEnded as ended:
                self._end(ended.outcome, ended.code)
            except Exception as error:  # noqa: BLE001 - any start failure must still stop what was started
                self.log.error("the fleet could not start:\n%s", traceback.format_exc())
                self._end(f"failed to start: {error}", 1)
        if self.outcome is None:
            threading.Thread(target=self._supervise_forever, name="supervise", daemon=True).start()
        return self.status()

    def status(self) -> dict[str, Any]:
        """The fleet now: members (name, index, node IP, pid), endpoints, restart counts, and the outcome
        (`reward` and `reward_address` are None when the run has no reward service)."""
        with self.lock:
            return {
                "run": self.run_name,
                "run_dir": str(self.config.run.run_dir),
                "outcome": self.outcome,
                "buffer_address": self.config.generator.buffer_address,
                "weights_address": self.config.generator.weights_address,
                "reward_address": self.config.reward.address if self.base.reward_service else None,
                "buffer": self.buffer.describe() if self.buffer else None,
                "reward": self.reward.describe() if self.reward else None,
                "learners": [m.describe() for m in self.learners],
                "generators": [m.describe() for m in self.generators],
                "retiring": [m.describe() for m in self.retiring],
                "restarts": dict(self.restarts),
                "faults": dict(self.faults),
            }

    def scale_generators(self, count: int) -> dict[str, Any]:
        """Run `count` generators: start new ones (new indices; they fetch the newest weights before leasing) or
        retire the newest ones (SIGTERM: they return their leases). Raises ValueError when the run has ended
        or count < 0; PlacementError at once when the cluster's free CPUs/GPUs cannot hold the new ones, or
        after ray.placement_timeout_s when they seemed to but could not be placed (other work took them, or no
        single node has a bundle's worth free)."""
        if count < 0:
            raise ValueError(f"generators: must be >= 0 (got {count})")
        with self.lock:
            if self.outcome is not None:
                raise ValueError(f"run {self.run_name} has ended ({self.outcome['outcome']}); nothing to scale")
            current = len(self.generators)
            if count > current:
                self._check_room(current, count)
                self._add_generators(count - current)
            for member in sorted(self.generators, key=lambda m: m.index)[count:]:
                self._retire(member)
            self.log.info("generators %d -> %d", current, count)
            self._report(force=True)
        return self.status()

    def wait(self, timeout_s: float) -> dict[str, Any] | None:
        """The outcome {"outcome": text, "code": exit code} once the run has ended, else None after timeout_s.
        The caller is the run's follower (`tandem ray CONFIG`), which removes the controller at the end."""
        self.last_followed = time.time()
        return self.outcome if self.ended.wait(timeout_s) else None  # set only once the fleet is stopped

    def ended_with(self) -> dict[str, Any] | None:
        """The outcome once the run has ended (the fleet stopped), else None; unlike wait(), no follower is noted."""
        return self.outcome if self.ended.is_set() else None

    def followed(self, within_s: float) -> bool:
        """Whether a follower waited on this run in the last `within_s` seconds (it then removes the controller)."""
        return time.time() - self.last_followed < within_s

    def stop(self, reason: str) -> dict[str, Any]:
        """Stop the whole fleet now (code 130); returns the outcome (the first one, if the run already ended)."""
        with self.lock:
            if self.outcome is None:
                self._end(f"stopped: {reason}", 130)
        return self.outcome

    # ------------------------------------------------------------------------------------------ start
    def _start_fleet(self) -> None:
        endpoints, master_port = self._place_services()
        self.config = fleet_config(self.base, endpoints)
        self.config_text = self.config.model_dump_json(indent=2)
        write_resolved(self.config, self.config.run.run_dir)
        self.log.info(
            "buffer %s, weights %s, reward service %s; %d learner process(es), %d generator(s)",
            self.config.generator.buffer_address,
            self.config.generator.weights_address,
            self.config.reward.address if self.reward else "none",
            len(self.learners),
            self.base.generator.count,
        )
        self._start_buffer()
        if self.reward:
            members.start([self.reward], [["reward"]], [{}], self.config_text)
        self._start_learners(master_port, resume=False)
        if self.reward:
            self._wait_reward_listening()
        self._add_generators(self.base.generator.count)
        self._report(force=True)

    def _place_services(self) -> tuple[Endpoints, int]:
        """Place the buffer, the reward service (if the run has one) and the learner ranks, and reserve the ports
        the services bind on their nodes: (their endpoints, MASTER_PORT). Every reserved port differs from the
        others (the config refuses a reward.port equal to buffer.port or learner.weights_port, whatever hosts)."""
        [self.buffer] = self._spawn("buffer", [0], self.pools["buffer"].acquire(1))
        if self.base.reward_service:
            [self.reward] = self._spawn("reward", [self._new_reward_index()], self.pools["reward"].acquire(1))
        ranks = learner_processes(self.base)
        self.learners = self._spawn("learner", list(range(ranks)), self.pools["learner"].acquire(ranks))
        buffer_host, weights_host = self._bind_host(self.buffer), self._bind_host(self.learners[0])
        reward_host = self._bind_host(self.reward) if self.reward else ""
        for host in {buffer_host, weights_host, reward_host} - {""}:
            problem = bind_problem(host, self.base)
            if problem:
                raise RunEnded(f"failed to start: {problem}", 2)
        rank0 = self.learners[0].actor
        buffer_port = call(self.buffer.actor.reserve_port.remote(buffer_host))
        weights_port, master_port = call(
            [rank0.reserve_port.remote(weights_host), rank0.reserve_port.remote(weights_host)]
        )
        reward_port = 0
        if self.reward:
            reward_port = distinct_port(
                lambda: call(self.reward.actor.reserve_port.remote(reward_host)),
                taken={buffer_port, weights_port, master_port},
            )
        endpoints = Endpoints(buffer_host, buffer_port, weights_host, weights_port, reward_host, reward_port)
        return endpoints, master_port

    def _bind_host(self, member: Member) -> str:
        """Where a service of `member` binds: loopback on the local Ray, its node's IP on a joined cluster."""
        return LOOPBACK if self.local_cluster else member.node["ip"]

    def _start_buffer(self) -> None:
        """Start the buffer and wait until it listens (a port taken meanwhile shows up here as its exit)."""
        members.start([self.buffer], [["buffer"]], [{}], self.config_text)
        code = call(self.buffer.actor.wait_listening.remote(self.config.buffer.port, members.CALL_TIMEOUT_S - 30))
        if code is not None:
            raise RunEnded(f"buffer-0 exited with code {code} at start: {self._failure(self.buffer)}", 1)

    def _wait_reward_listening(self) -> None:
        """Wait (up to REWARD_START_S: it loads its model first) until the reward service listens on reward.port;
        RunEnded (code 1) with its failure line if it exits first, or if it is still not listening by then."""
        import ray
        from ray.exceptions import GetTimeoutError

        port = self.config.reward.port
        try:
            code = ray.get(self.reward.actor.wait_listening.remote(port, REWARD_START_S), timeout=REWARD_START_S + 30)
        except (TimeoutError, GetTimeoutError):
            raise RunEnded(
                f"{self.reward.name} did not listen on port {port} within {REWARD_START_S:.0f}s: "
                f"{self._failure(self.reward)}",
                1,
            ) from None
        if code is not None:
            raise RunEnded(f"{self.reward.name} exited with code {code} at start: {self._failure(self.reward)}", 1)

    def _start_learners(self, master_port: int, resume: bool) -> None:
        nodes = [m.node["node_id"] for m in self.learners]
        master = LOOPBACK if self.local_cluster else self.learners[0].node["ip"]
        own_device = self.base.ray.learner_gpus > 0
        argv = ["learner", *(["--learner.resume", "true"] if resume else [])]
        envs = [
            {} if self.config.run.simulate else learner_env(rank, nodes, master, master_port, own_device)
            for rank in range(len(self.learners))
        ]
        members.start(self.learners, [argv] * len(self.learners), envs, self.config_text)

    def _add_generators(self, count: int) -> None:
        """Place and start `count` generators at once, with indices never used before in this run."""
        indices = list(range(self.next_generator_index, self.next_generator_index + count))
        self.next_generator_index += count
        added = self._spawn("generator", indices, self.pools["generator"].acquire(count))
        arguments = [["generator", "--generator.index", str(m.index), *self._relay_host(m)] for m in added]
        members.start(added, arguments, [{}] * count, self.config_text)
        self.generators += added
        for member in added:
            self.log.info("%s started on %s (pid %s)", member.name, member.node["ip"], member.pid)

    def _check_room(self, current: int, count: int) -> None:
        """PlacementError at once, instead of after ray.placement_timeout_s, when the cluster's free resources
        cannot hold the generators that scaling from `current` to `count` adds."""
        problem = self.pools["generator"].room_problem(count - current)
        if problem:
            raise PlacementError(f"run {self.run_name} has {current} generator(s), {count} asked: {problem}")

    def _relay_host(self, member: Member) -> list[str]:
        """Where a generator's weights relay binds: its node's IP on a joined cluster (other nodes' generators
        pull chunks from it), loopback on the local one."""
        return [] if self.local_cluster else ["--weights.relay_host", member.node["ip"]]

    def _spawn(self, role: str, indices: list[int], slots: list[Slot]) -> list[Member]:
        ray_config = self.base.ray
        cpus = {
            "buffer": ray_config.buffer_cpus,
            "learner": ray_config.learner_cpus,
            "generator": ray_config.generator_cpus,
            "reward": ray_config.reward_cpus,
        }[role]
        gpus = {
            "buffer": 0.0,
            "learner": ray_config.learner_gpus,
            "generator": ray_config.generator_gpus,
            "reward": ray_config.reward_gpus,
        }[role]
        return members.spawn(self.run_name, role, indices, slots, cpus, gpus, self.run_dir)

    # ------------------------------------------------------------------------------------------ supervision
    def _supervise_forever(self) -> None:
        while not self.ended.is_set():
            with self.lock:
                if self.outcome is not None:
                    return
                try:
                    self._supervise_once()
                except RunEnded as ended:
                    self._end(ended.outcome, ended.code)
                except Exception as error:  # noqa: BLE001 - the controller must stop the fleet, not die silently
                    self.log.error("supervision failed:\n%s", traceback.format_exc())
                    self._end(f"controller error: {error}", 1)
            time.sleep(SUPERVISE_S)

    def _supervise_once(self) -> None:
        reward = [self.reward] if self.reward else []
        codes = members.exits([self.buffer, *reward, *self.learners, *self.generators], self.faults)
        self._check_buffer(codes[self.buffer.name])
        if self.reward and codes[self.reward.name] is not None:
            self._restart_reward(codes[self.reward.name])
        for member in self.learners:
            if codes[member.name] not in (None, 0):
                self._on_learner_failure(member, codes[member.name])
                return
        if all(codes[member.name] == 0 for member in self.learners):
            raise RunEnded("finished", 0)
        for member in list(self.generators):
            code = codes[member.name]
            if code == 0:
                self.log.info("%s exited 0 (out of prompts, or the run is over)", member.name)
                self._remove(member, grace_s=0)
            elif code is not None:
                self._replace_generator(member, code)
        self._collect_retired()
        self._report()

    def _check_buffer(self, code: Any) -> None:
        """A buffer that exited 0 ended the run (the learner's final report): the learner ranks get their stop
        grace to save and exit. Any other exit of the buffer, or a learner still running after that, ends the run."""
        if code == 0:
            self.buffer_gone_at = self.buffer_gone_at or time.monotonic()
            if time.monotonic() - self.buffer_gone_at < stop_grace_s(self.config, "learner"):
                return
            raise RunEnded(f"buffer-0 exited 0 but the learner did not finish: {self._failure(self.buffer)}", 1)
        if code is not None:
            raise RunEnded(f"buffer-0 ended ({describe_code(code)}): {self._failure(self.buffer)}", 1)

    def _replace_generator(self, member: Member, code: Any) -> None:
        self.restarts["generator"] += 1
        limit = self.base.ray.max_generator_restarts
        self.log.warning(
            "%s ended (%s); replacing it (%d/%d): %s",
            member.name,
            describe_code(code),
            self.restarts["generator"],
            limit,
            self._failure(member),
        )
        if self.restarts["generator"] > limit:
            raise RunEnded(
                f"{member.name} ended ({describe_code(code)}) and ray.max_generator_restarts = {limit} "
                "replacements are used up",
                1,
            )
        self._remove(member, grace_s=0)
        self._add_generators(1)

    def _restart_reward(self, code: Any) -> None:
        """The reward service ended (any exit: the generators still score through it): start a new one (a new
        index, its own log) in the same slot and on the same port, so that reward.address, which every
        generator read from config.json, stays right. RunEnded past ray.max_reward_restarts, or when the slot now
        lies on another node (Ray re-placed the bundle of a lost node): its address would change under the
        generators. Its port is first waited for (a predecessor whose actor died may still be closing it), the
        replacement itself is not: the generators fall back until it listens."""
        old = self.reward
        self.restarts["reward"] += 1
        limit = self.base.ray.max_reward_restarts
        why = f"{old.name} ended ({describe_code(code)})"
        self.log.warning("%s; restarting it (%d/%d): %s", why, self.restarts["reward"], limit, self._failure(old))
        if self.restarts["reward"] > limit:
            raise RunEnded(f"{why} and ray.max_reward_restarts = {limit} restarts are used up", 1)
        self._stop_members([old], grace_s=0, release=False)
        [self.reward] = self._spawn("reward", [self._new_reward_index()], [old.slot])
        if not self.local_cluster and self.reward.node["ip"] != old.node["ip"]:
            raise RunEnded(
                f"{why} and its slot moved from node {old.node['ip']} to {self.reward.node['ip']}: the generators "
                f"reach the reward service at {self.config.reward.address}, which a new node cannot bind",
                1,
            )
        host, port = self.config.reward.host, self.config.reward.port
        if not call(self.reward.actor.wait_port_free.remote(host, port, stop_grace_s(self.base, "buffer"))):
            self.log.warning(
                "%s:%d is still taken; starting %s anyway (if it cannot bind, it exits)", host, port, self.reward.name
            )
        members.start([self.reward], [["reward"]], [{}], self.config_text)
        self.log.info(
            "%s started on %s (pid %s), port %d",
            self.reward.name,
            self.reward.node["ip"],
            self.reward.pid,
            self.config.reward.port,
        )
        self._report(force=True)

    def _new_reward_index(self) -> int:
        index, self.next_reward_index = self.next_reward_index, self.next_reward_index + 1
        return index

    def _on_learner_failure(self, member: Member, code: Any) -> None:
        """End the run, or (within ray.max_learner_restarts) restart it in place from the latest checkpoint."""
        why = f"{member.name} ended ({describe_code(code)})"
        self.log.error("%s: %s", why, self._failure(member))
        self.learner_failed = True
        limit = self.base.ray.max_learner_restarts
        if self.restarts["learner"] >= limit:
            raise RunEnded(
                f"{why}; the latest complete checkpoint in {self.config.run.run_dir / 'checkpoints'} "
                "can be resumed with --learner.resume true",
                1,
            )
        self.restarts["learner"] += 1
        self.log.warning("restarting the run from the latest checkpoint (%d/%d)", self.restarts["learner"], limit)
        self._restart_from_checkpoint()

    def _restart_from_checkpoint(self) -> None:
        """Every role restarts in its slot on the same ports (the fleet config stays valid): generators stopped
        first, then the ranks and the buffer; the buffer comes back afresh (its admission counts the steps the
        lost learner took after its checkpoint, so it could not serve the resumed one), the ranks resume with
        `--learner.resume true`, and new generators fetch the resumed weights."""
        generators = len(self.generators)
        self._stop_members(self.generators + self.retiring, stop_grace_s(self.base, "generator"))
        self.generators = []
        # a group with a dead rank cannot checkpoint (its save is collective): the survivors get only the margin
        self._stop_members(self.learners + [self.buffer], stop_grace_s(self.base, "buffer"), release=False)
        self.buffer_gone_at = None
        for old in (self.buffer, *self.learners):
            members.wait_name_released(self.run_name, old.name)
        [self.buffer] = self._spawn("buffer", [0], [self.buffer.slot])
        self.learners = self._spawn("learner", [m.index for m in self.learners], [m.slot for m in self.learners])
        self._start_buffer()
        master_host = LOOPBACK if self.local_cluster else self.learners[0].node["ip"]
        self._start_learners(call(self.learners[0].actor.reserve_port.remote(master_host)), resume=True)
        self.learner_failed = False
        self._add_generators(generators)

    # ------------------------------------------------------------------------------------------ stopping
    def _retire(self, member: Member) -> None:
        """Scale down: SIGTERM now (non-blocking); the slot is freed once the role has exited."""
        self.generators.remove(member)
        member.stopping = member.actor.stop.remote(stop_grace_s(self.base, "generator"))
        self.retiring.append(member)
        self.log.info("%s retiring: it finishes or returns its leases", member.name)

    def _collect_retired(self) -> None:
        """Drop the actors (and free the slots) of retiring generators whose role has exited."""
        import ray

        if not self.retiring:
            return
        done, _ = ray.wait([m.stopping for m in self.retiring], num_returns=len(self.retiring), timeout=0)
        finished = [m for m in self.retiring if m.stopping in done]
        self._stop_members(finished, grace_s=0)

    def _remove(self, member: Member, grace_s: float) -> None:
        self.generators.remove(member)
        self._stop_members([member], grace_s)

    def _stop_members(self, stopping: list[Member], grace_s: float, release: bool = True) -> None:
        """Stop these members at once (members.stop) and free their slots, unless `release` is False (they are
        about to be reused)."""
        members.stop(stopping, grace_s, self.faults, self.log)
        for member in stopping:
            if release:
                self.pools[member.role].release(member.slot)
        self.retiring = [m for m in self.retiring if m not in stopping]

    def _end(self, outcome: str, code: int) -> None:
        """Record the outcome and stop the fleet in order: generators, learners, then the reward service and the
        buffer (see launch.local).
        `ended` is set last, whatever happens while stopping, so that `wait` returns only then."""
        level = self.log.info if code == 0 else self.log.error
        level("run %s ends: %s (code %d)", self.run_name, outcome, code)
        self.outcome = {"outcome": outcome, "code": code}
        try:
            self._stop_members(self.generators + self.retiring, stop_grace_s(self.base, "generator"))
            self.generators = []
            # healthy ranks finish their step and checkpoint; beside a dead rank they could not (a collective save)
            learner_grace = stop_grace_s(self.base, "buffer" if self.learner_failed else "learner")
            self._stop_members(self.learners, learner_grace)
            self.learners = []
            services = [member for member in (self.reward, self.buffer) if member is not None]
            self._stop_members(services, stop_grace_s(self.base, "buffer"))
            self.reward = self.buffer = None
            for pool in self.pools.values():
                pool.close()
            self._report(force=True)
            self.metrics.close()
        finally:
            self.ended.set()

    # ------------------------------------------------------------------------------------------ helpers
    def _report(self, force: bool = False) -> None:
        self.ticks += 1
        if force or self.ticks % REPORT_EVERY == 0:
            self.metrics.log(
                self.ticks,
                {
                    "ray/generators": len(self.generators),
                    "ray/generators_retiring": len(self.retiring),
                    "ray/learner_processes": len(self.learners),
                    "ray/generator_restarts": self.restarts["generator"],
                    "ray/learner_restarts": self.restarts["learner"],
                    "ray/reward_restarts": self.restarts["reward"],
                    "ray/actors_died": self.faults["actors_died"],
                    "ray/stop_timeouts": self.faults["stop_timeouts"],
                },
            )

    def _failure(self, member: Member) -> str:
        return members.failure(member, self.run_dir)
