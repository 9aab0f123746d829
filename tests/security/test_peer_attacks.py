"""Peers that try to kill the learner or rob the run (issue 12, item 4), and keys at rest (item 8).

Played against a real buffer process (`tandem buffer`, journal on) over loopback, while the real learner link
(`learners.buffer_link.BufferLink`) trains in a thread and a generator leases prompts and pushes groups. Each attack
must be refused and counted (`rejected_<kind>`), never journaled: the buffer stopped and restarted from its journal
holds the learner's real step and carries on; the learner keeps training (it never exits on a refusal) and the
generator keeps getting leases; the accounting identity holds throughout. With CURVE per-role keys, a client holding
the generator key cannot report versions or draw batches; a secret key file others may read is refused at start.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.keys import write_keys
from common.sockets import Client, PeerUnavailable, SocketSecurity
from common.types import (
    MAX_VERSION,
    Batch,
    BatchRequest,
    BufferStats,
    ErrorReply,
    GroupAck,
    Heartbeat,
    LeaseGrant,
    LeaseRefused,
    LeaseRequest,
    Ok,
    StatsRequest,
    VersionReport,
)
from launch.testing import RoleUnderTest, run_config, wait_until
from learners.buffer_link import BufferLink
from tests.buffers.fakes import make_group

pytestmark = pytest.mark.integration
GROUP = 4
B = 2  # learner.groups_per_step
PLAIN = SocketSecurity()
WAIT_S = 60.0  # for a state to come about on a loaded 2-core machine (the runs take a few seconds)


def _call(client: Client, message: Any, timeout_s: float = 2.0) -> Any:
    """Send until answered: the buffer may be restarting."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            return client.request(message, timeout_s=timeout_s)[0]
        except PeerUnavailable:
            time.sleep(0.05)
    raise TimeoutError(f"no answer to {type(message).__name__}")


class LearnerThread(threading.Thread):
    """The learner's side as `learners.learner` drives it, without a trainer: announce, then per step fetch the
    batch and report the next step. Stops (between steps) when `stop` is set; records the steps trained."""

    def __init__(self, address: str, security: SocketSecurity = PLAIN) -> None:
        super().__init__(daemon=True)
        self.link = BufferLink(address, security, 0, 1, B, hold_s=0.5, reply_margin_s=2.0, reconnect_max_s=0.5)
        self.steps: list[int] = []
        self.stop, self.error = threading.Event(), None

    def run(self) -> None:
        try:
            self.link.report_version(0, 0, resync=True)
            step = 0
            while not self.stop.is_set():
                batch, _ = self.link.fetch_batch(step)
                assert batch.step == step and len(batch.groups) == B
                self.steps.append(step)
                step += 1
                self.link.report_version(step, step)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.error = error
        finally:
            self.link.close()


class GeneratorThread(threading.Thread):
    """Leases at the buffer's learner version (from its heartbeat replies) and pushes one group per prompt;
    `paused` holds it between leases."""

    def __init__(self, address: str, security: SocketSecurity = PLAIN) -> None:
        super().__init__(daemon=True)
        self.client = Client(address, security, identity="generator-0", role="generator")
        self.grants, self.acks = 0, Counter()
        self.stop, self.paused, self.error = threading.Event(), threading.Event(), None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                if self.paused.is_set():
                    time.sleep(0.02)
                    continue
                version = _call(self.client, Heartbeat(0, 0, [])).learner_version
                reply = _call(self.client, LeaseRequest(0, B, version))
                if isinstance(reply, LeaseRefused):
                    time.sleep(min(reply.retry_after_s, 0.05))
                    continue
                if isinstance(reply, ErrorReply):  # counted and asked again, as the real generator does (see below)
                    self.acks[f"lease_refused_{reply.kind}"] += 1
                    time.sleep(0.05)
                    continue
                assert isinstance(reply, LeaseGrant), reply
                self.grants += 1
                for prompt in reply.prompts:
                    ack = _call(self.client, make_group(reply.lease_id, prompt, 0, GROUP, version))
                    # refused (as a real generator's outbox counts it): e.g. future_version, when a learner-role
                    # peer's announcement moved the buffer's newest version below the one this group was made at
                    # (until the learner re-announces its own step)
                    assert isinstance(ack, (GroupAck, ErrorReply)), ack
                    self.acks[ack.status if isinstance(ack, GroupAck) else f"refused_{ack.kind}"] += 1
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.error = error
        finally:
            self.client.close()


class Run:
    """A buffer process with a training learner and a pushing generator; `attack` sends as another peer."""

    def __init__(self, tmp_path: Path, keys: Path | None = None) -> None:
        self.security = SocketSecurity(curve_keys_dir=keys)
        config = run_config(
            tmp_path / "runs",
            "attacks",
            run={"seed": 0, **({"curve_keys_dir": str(keys)} if keys else {})},
            buffer={"capacity": 64, "persist": True, "heartbeat_timeout_s": 5.0, "lease_timeout_s": 30.0},
            algo={"group_size": GROUP, "max_staleness": 1},
            env={"num_prompts": 400},
            learner={"groups_per_step": B},
        )
        self.address = config.generator.buffer_address
        self.buffer_port, self.weights_port = config.buffer.port, config.learner.weights_port
        self.buffer = RoleUnderTest(config, "buffer")
        self.learner = LearnerThread(self.address, self.security)
        self.generator = GeneratorThread(self.address, self.security)

    def start(self) -> Run:
        self.buffer.start()
        self.buffer.wait_until(lambda: self.stats(timeout_s=1.0), WAIT_S, "the buffer's first answer")
        self.learner.start()
        self.generator.start()
        return self

    def stats(self, timeout_s: float = 5.0) -> BufferStats | None:
        client = Client(self.address, self.security, "stats", role="monitor" if self.security.curve_keys_dir else None)
        try:
            return client.request(StatsRequest(), timeout_s=timeout_s)[0]
        except PeerUnavailable:
            return None
        finally:
            client.close()

    def counters(self) -> dict[str, int]:
        return self.buffer.wait_until(self.stats, WAIT_S, "stats").counters

    def trained(self, steps: int) -> None:
        """Wait until the learner has trained `steps` more steps."""
        target = len(self.learner.steps) + steps
        what = f"{target} steps (the generator: {self.generator.acks}, error {self.generator.error!r})"
        wait_until(lambda: len(self.learner.steps) >= target or self.learner.error, WAIT_S, what)
        assert self.learner.error is None, repr(self.learner.error)

    def attack(self, role: str | None, message: Any, times: int = 1) -> list[Any]:
        """Send `message` `times` times as a peer of `role` (on its own connection); the replies."""
        client = Client(self.address, self.security, identity="attacker", role=role)
        try:
            return [_call(client, message) for _ in range(times)]
        finally:
            client.close()

    def survives(self) -> None:
        """The learner trains on and the generator leases on; restarted from its journal the buffer holds the
        learner's own step (no refused report was replayed) and both carry on; the ledger balances."""
        grants = self.generator.grants
        self.trained(3)
        wait_until(lambda: self.generator.grants > grants, WAIT_S, "a lease after the attack")
        _assert_balanced(self.counters())
        reported = self.learner.link.announced[1]  # answered, so journaled before the stop
        assert self.buffer.stop(grace_s=20) == 0
        self.buffer.start()
        restored = self.buffer.wait_until(self.stats, WAIT_S, "the restarted buffer's stats").learner_version
        assert reported <= restored <= len(self.learner.steps), (reported, restored, len(self.learner.steps))
        grants = self.generator.grants
        self.trained(3)
        wait_until(lambda: self.generator.grants > grants, WAIT_S, "a lease after the restart")
        _assert_balanced(self.counters())
        assert self.learner.error is None and self.generator.error is None

    def close(self) -> None:
        self.learner.stop.set()
        self.learner.join(timeout=WAIT_S)  # the generator still feeds it: its last fetch returns
        self.generator.stop.set()
        self.generator.join(timeout=WAIT_S)
        self.buffer.kill()


def _assert_balanced(counters: dict[str, int]) -> None:
    outflows = sum(counters[k] for k in ("trained", "dropped_stale", "evicted", "rejected", "buffered"))
    assert counters["arrived"] == outflows, counters


def _refused(replies: list[Any], *kinds: str) -> None:
    assert all(isinstance(r, ErrorReply) and r.kind in kinds for r in replies), replies


@pytest.fixture
def run(tmp_path: Path) -> Iterator[Run]:
    made = Run(tmp_path).start()
    try:
        yield made
    finally:
        made.close()


def test_repeated_version_report_0_0_is_refused_and_the_learner_keeps_training(run: Run) -> None:
    run.trained(3)
    _refused(run.attack(None, VersionReport(0, 0), times=10), "forbidden_role")
    _refused(run.attack("generator", VersionReport(0, 0), times=10), "forbidden_role")
    _refused(run.attack("learner", VersionReport(0, 0), times=10), "version_backwards")  # a plain report: forward only
    counters = run.counters()
    assert counters["rejected_forbidden_role"] == 20 and counters["rejected_version_backwards"] == 10
    run.survives()
    # even a learner-role peer's announcement (resync, trusted: it rewinds) only delays the learner: refused at its
    # next request, it re-announces its own step and trains on
    assert all(isinstance(r, Ok) for r in run.attack("learner", VersionReport(0, 0, resync=True), times=3))
    run.trained(3)


def test_a_draw_for_the_next_step_with_another_world_size_is_refused_and_not_journaled(run: Run) -> None:
    run.trained(2)
    kinds = ("batch_shape", "batch_mismatch", "old_step")  # not drawn yet / drawn meanwhile / trained meanwhile
    for _ in range(5):
        step = run.counters()["served_groups"] // B  # the step after the last one drawn: the learner's next
        _refused(run.attack("generator", BatchRequest(step, 1, 2, B, 0.0)), "forbidden_role")
        _refused(run.attack("learner", BatchRequest(step, 1, 2, B, 0.0)), *kinds)
    counters = run.counters()
    assert counters["rejected_forbidden_role"] == 5
    assert sum(counters.get(f"rejected_{kind}", 0) for kind in kinds) == 5
    run.survives()


def test_a_batch_request_for_an_old_step_gets_no_fresh_groups(run: Run) -> None:
    run.trained(4)
    _refused(run.attack("generator", BatchRequest(1, 0, 1, B, 0.0)), "forbidden_role")
    replies = run.attack("learner", BatchRequest(1, 0, 1, B, 0.0), times=5)
    _refused(replies, "old_step")  # with no batch: nothing handed over, nothing consumed
    assert run.counters()["rejected_old_step"] == 5
    run.survives()


def test_a_second_request_for_the_learners_held_step_does_not_take_its_batch(run: Run) -> None:
    run.trained(2)
    run.generator.paused.set()
    held_step = len(run.learner.steps)  # the learner asks for it now; with no groups coming it is held
    waits = run.learner.link.counters["batch_not_ready"]
    wait_until(lambda: run.learner.link.counters["batch_not_ready"] > waits + 1, WAIT_S, "the learner held")
    _refused(run.attack("generator", BatchRequest(held_step, 0, 1, B, 5.0)), "forbidden_role")
    # A learner-role peer (trusted with the data: it is sent the same share) asks for the held step too, on its own
    # connection. Held beside the learner's request, not in its place, it takes nothing from it: the learner is
    # answered on time (a displaced request would go unanswered until its reply deadline: buffer_unavailable).
    other: list[Any] = []
    thief = threading.Thread(target=lambda: other.extend(run.attack("learner", BatchRequest(held_step, 0, 1, B, 5.0))))
    thief.start()
    run.generator.paused.clear()
    thief.join(timeout=WAIT_S)
    run.trained(1)
    assert held_step in run.learner.steps
    assert run.learner.link.counters["buffer_unavailable"] == 0
    assert len(other) == 1 and isinstance(other[0], (Batch, ErrorReply)), other  # a copy, or old_step if late
    run.survives()


def test_a_spoofed_huge_step_is_refused_and_generators_keep_getting_leases(run: Run) -> None:
    run.trained(2)
    _refused(run.attack("generator", VersionReport(0, MAX_VERSION), times=3), "forbidden_role")
    for resync in (False, True):
        _refused(run.attack("learner", VersionReport(0, MAX_VERSION, resync=resync), times=3), "version_jump")
        _refused(run.attack("learner", VersionReport(MAX_VERSION, MAX_VERSION, resync=resync)), "version_jump")
    counters = run.counters()
    assert counters["rejected_version_jump"] == 8 and counters["rejected_forbidden_role"] == 3
    assert run.stats().learner_version <= len(run.learner.steps)  # the learner's own step, not the spoofed one
    run.survives()


def test_with_curve_keys_the_generator_key_cannot_report_versions_or_draw_batches(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    write_keys(keys)
    run = Run(tmp_path, keys=keys).start()
    try:
        run.trained(2)
        forged = Client(run.address, run.security, identity="learner-0", role="generator")
        try:
            for message in (VersionReport(0, 0), VersionReport(0, 0, resync=True), BatchRequest(0, 0, 1, B, 0.0)):
                reply = _call(forged, message)
                assert isinstance(reply, ErrorReply) and reply.kind == "forbidden_role", reply
        finally:
            forged.close()
        keyless = Client(run.address, PLAIN, identity="learner-0", role="learner")  # no key: never gets through
        with pytest.raises(PeerUnavailable):
            keyless.request(VersionReport(0, 0, resync=True), timeout_s=1.0)
        keyless.close()
        assert run.counters()["rejected_forbidden_role"] == 3
        run.survives()
    finally:
        run.close()


def test_a_secret_key_file_others_can_read_is_refused_at_start(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    write_keys(keys)
    os.chmod(keys / "server.key_secret", 0o644)
    run = Run(tmp_path, keys=keys)
    run.buffer.start()
    code = run.buffer.wait(WAIT_S)
    assert code != 0 and f"chmod 600 {keys / 'server.key_secret'}" in run.buffer.output(), run.buffer.tail()
    assert code != -signal.SIGKILL


def test_a_learner_refused_for_good_stops_with_the_buffers_reason(tmp_path: Path) -> None:
    """A learner machine given the generator's secret as its own: every request it sends is a generator's, refused
    (forbidden_role). The learner (a real process, simulated trainer) stops at once with exit code 1 and the reason
    in its log, not a traceback and not a retry loop; the buffer stays up."""
    keys = tmp_path / "keys"
    write_keys(keys)
    (keys / "learner.key_secret").write_bytes((keys / "generator.key_secret").read_bytes())  # still 0600
    buffer_run = Run(tmp_path, keys=keys)
    buffer_run.buffer.start()
    assert buffer_run.buffer.wait_until(buffer_run.stats, WAIT_S, "the buffer's first answer")
    config = run_config(
        tmp_path / "runs",
        "attacks",
        ports=(buffer_run.buffer_port, buffer_run.weights_port),
        run={"simulate": True, "curve_keys_dir": str(keys)},
        algo={"group_size": GROUP, "max_staleness": 1},
        learner={"groups_per_step": B, "total_steps": 4},
    )
    learner = RoleUnderTest(config, "learner")
    try:
        learner.start()
        assert learner.wait(WAIT_S) == 1, learner.tail()
        log = (config.run.run_dir / "logs" / "learner-0.log").read_text()
        assert "stopping at step 0" in log and "may not send 'version_report'" in log, log
        assert "Traceback" not in learner.output(), learner.tail()
        assert buffer_run.counters()["rejected_forbidden_role"] >= 1
    finally:
        learner.kill()
        buffer_run.buffer.kill()
