"""The harness that tests and benchmarks share: roles as real processes, and fake peers over real loopback sockets.

    config = run_config(tmp_path / "runs", "gen", model={"path": str(model_dir)}, algo={"group_size": 4})
    with FakeBuffer(config, arithmetic_items(8)) as buffer, FakePublisher(config.learner.weights_port) as publisher:
        with RoleUnderTest(config, "generator") as generator:     # python -m launch.cli generator <run_dir>/config.json
            buffer.wait_for_groups(8, timeout_s=60)
            publisher.publish(1, arrays)
            assert generator.stop() == 0                           # SIGTERM, a grace period, then SIGKILL

`run_config` is the one way a test or a benchmark writes a run: a base TOML file (or the defaults), sections
merged in, and every address on free loopback ports. `RoleUnderTest` starts any `launch.cli` command from the
resolved config the way `tandem run` starts a role (`launch.local.Role`: its own session, output in
`<run_dir>/logs/<name>.out`, no inherited torch.distributed variables) and always kills its whole process group
on the way out, vLLM's and torchrun's children included. `FakeBuffer` answers generators with the real
`buffers.core.BufferCore`; the test only chooses the prompts. `FakePublisher` is the learner's weight publisher.

Imports no pytest, torch, vllm or deepspeed. Failure modes: a role that exits or a condition that does not hold in
time raises `RoleFailed` with the tail of the role's output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from buffers.core import BufferCore, RequestRejected
from buffers.state import BufferSettings, BufferState
from common.config import TandemConfig, load_config, write_resolved
from common.sockets import Server, SocketSecurity, free_port
from common.types import (
    GroupAck,
    Heartbeat,
    LeaseGrant,
    LeaseRefused,
    LeaseRequest,
    LeaseReturn,
    PromptItem,
    RolloutGroup,
)
from common.weight_messages import TensorSpec, WeightsHeader, WeightsNotNewer, WeightsRequest
from common.weights import DEFAULT_BUCKET_MB, check_frames, plan_buckets, storage_dtype
from launch.local import Role

if TYPE_CHECKING:
    from actors.environments.episodes import EpisodeDriver, EpisodeGroup

__all__ = [
    "FakeBuffer",
    "FakePublisher",
    "RoleFailed",
    "RoleUnderTest",
    "ServerThread",
    "arithmetic_items",
    "drive_until_done",
    "free_port",
    "loopback_overrides",
    "override_args",
    "pack_weights",
    "run_config",
    "unpack_weights",
    "wait_until",
]

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the directory that holds actors/ buffers/ ... launch/


class RoleFailed(RuntimeError):
    """A role exited, or a condition did not hold, before the test could go on; says which, with its output."""


# ---------------------------------------------------------------------------------------------------- configs
def loopback_overrides(buffer_port: int, weights_port: int) -> dict[str, Any]:
    """Dotted overrides that put the buffer and the weight publisher on these loopback ports, for every role (the
    addresses a config leaves out follow them). Two free ports rather than one `run.port_base`: the port after a
    free one may be taken."""
    return {
        "buffer.host": "127.0.0.1",
        "buffer.port": buffer_port,
        "learner.weights_host": "127.0.0.1",
        "learner.weights_port": weights_port,
    }


def run_config(
    root: Path,
    name: str,
    base: Path | None = None,
    ports: tuple[int, int] | None = None,
    **sections: Mapping[str, Any],
) -> TandemConfig:
    """A validated run `root/name`: `base` (a TOML file, or the defaults) with `sections` set on top
    (`generator={"max_tokens": 8}`; a table is a dict value), on loopback `ports` (buffer, weights; fresh free ports
    if None). Raises ConfigError naming the key that is wrong."""
    buffer_port, weights_port = ports if ports is not None else (free_port(), free_port())
    overrides = {"run.root": str(root), "run.name": name, **loopback_overrides(buffer_port, weights_port)}
    for section, values in sections.items():
        overrides.update({f"{section}.{key}": value for key, value in values.items()})
    return load_config(base, overrides)


def override_args(overrides: Mapping[str, Any]) -> list[str]:
    """`{"algo.max_staleness": 0, "generator.cpu_cores": "0,1"}` -> `--algo.max_staleness 0 --generator.cpu_cores
    '"0,1"'`: the command line a user would type; strings are JSON-quoted so that they parse back as strings (a
    bare `1` would be an integer), booleans are TOML's."""
    args: list[str] = []
    for key, value in overrides.items():
        text = json.dumps(value) if isinstance(value, (bool, str)) else str(value)
        args += [f"--{key}", text]
    return args


def arithmetic_items(count: int, explode_every: int = 0, first_id: int = 0) -> list[PromptItem]:
    """Prompts "What is i + i?" with ids `first_id`...; every `explode_every`-th one asks the test reward function
    (tests.actors.reward_fns) to raise."""
    items = []
    for i in range(first_id, first_id + count):
        metadata: dict[str, Any] = {"answer": 2 * i, "explode": bool(explode_every and i % explode_every == 0)}
        messages = [{"role": "user", "content": f"What is {i} + {i}?"}]
        items.append(PromptItem(prompt_id=i, epoch=0, messages=messages, metadata=metadata))
    return items


def wait_until(condition: Callable[[], Any], timeout_s: float, what: str, role: RoleUnderTest | None = None) -> Any:
    """Poll `condition` until it returns something true (returned); RoleFailed after `timeout_s`, or as soon as
    `role` (if given) has exited, with the tail of its output."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if role is not None and role.poll() is not None:
            raise RoleFailed(f"{role.name} exited ({role.poll()}) before {what}:\n{role.tail()}")
        if time.monotonic() > deadline:
            raise RoleFailed(f"timed out after {timeout_s}s waiting for {what}" + (f":\n{role.tail()}" if role else ""))
        time.sleep(0.05)


def drive_until_done(driver: EpisodeDriver, timeout_s: float, idle_wait_s: float = 0.005) -> list[EpisodeGroup]:
    """Run the driver's engine until every started episode has ended; the complete groups, in completion order.

    The generator's loop in miniature (without leases, weights or sockets). Raises TimeoutError when episodes are
    still running after `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    groups: list[EpisodeGroup] = []
    while driver.active():
        if time.monotonic() > deadline:
            raise TimeoutError(f"episodes still running after {timeout_s}s")
        groups.extend(driver.advance(submit=True))
        if driver.engine.num_unfinished():
            for sample in driver.engine.step():
                driver.on_turn(sample)
        elif driver.active():
            driver.wait(idle_wait_s)
    return groups


# ---------------------------------------------------------------------------------------------------- roles
class RoleUnderTest:
    """`python -m launch.cli COMMAND <run_dir>/config.json ARGS...` (COMMAND: buffer, generator, learner, run, ray)
    started from the resolved `config` as `tandem run` starts a role; not started until `start()` or `with`.

    Output (stdout and stderr) goes to `<run_dir>/logs/<command>-<index>.out`, appended across restarts. Leaving
    the `with` block SIGKILLs the process group, whatever happened; `stop()` first asks politely.
    """

    def __init__(
        self,
        config: TandemConfig,
        command: str,
        *args: str,
        index: int = 0,
        cores: set[int] | None = None,
        netns: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """`netns`: run it inside that network namespace (`ip netns exec`), a host of a test's own network; `env`:
        variables set for it besides this process's."""
        self.run_dir = config.run.run_dir
        self.config_path = write_resolved(config, self.run_dir)
        argv = [sys.executable, "-m", "launch.cli", command, str(self.config_path)]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        if command == "generator":
            argv += ["--generator.index", str(index)]
        pythonpath = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
        self.role = Role(f"{command}-{index}", [*argv, *args], cores, env={"PYTHONPATH": pythonpath, **(env or {})})

    @property
    def name(self) -> str:
        return self.role.name

    @property
    def pid(self) -> int:
        if self.role.process is None:
            raise RoleFailed(f"{self.name} was never started")
        return self.role.process.pid

    @property
    def output_path(self) -> Path:
        return self.run_dir / "logs" / f"{self.name}.out"

    def start(self) -> Self:
        """Start (again, after it exited: the same config, the same ports)."""
        if self.poll() is None and self.role.process is not None:
            raise RoleFailed(f"{self.name} is already running (pid {self.pid})")
        self.role.start(self.run_dir)
        return self

    def poll(self) -> int | None:
        return self.role.poll()

    def wait(self, timeout_s: float) -> int:
        """The exit code; RoleFailed if it still runs after `timeout_s`."""
        code = self.role.wait(time.time() + timeout_s)
        if code is None:
            raise RoleFailed(f"{self.name} still running after {timeout_s}s:\n{self.tail()}")
        return code

    def wait_until(self, condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
        """Poll `condition` until true (returned); RoleFailed if the role exits first or time runs out."""
        return wait_until(condition, timeout_s, what, self)

    def send_signal(self, signum: int) -> None:
        """`signum` to the role's process only (not its group): what a shell's `kill` would do."""
        if self.poll() is None:
            os.kill(self.pid, signum)

    def stop(self, grace_s: float = 30.0, signum: int = signal.SIGTERM) -> int:
        """`signum` to the role, then SIGKILL to its whole group after `grace_s` (or at once once it exited, for the
        children it left behind); its exit code (negative: the signal that ended it)."""
        self.send_signal(signum)
        self.role.wait(time.time() + grace_s)
        self.kill()
        return self.poll()

    def kill(self) -> None:
        """SIGKILL the whole process group now (even if the leader exited) and reap the leader."""
        self.role.kill_group()

    def output(self) -> str:
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""

    def tail(self, chars: int = 4000) -> str:
        return self.output()[-chars:]

    def __enter__(self) -> Self:
        return self if self.role.process is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


# ---------------------------------------------------------------------------------------------------- fake peers
class ServerThread(ABC):
    """A `common.sockets.Server` polled in a daemon thread; `answer(request)` gives the (reply_to, message,
    payload) triples to send now. `stop()` closes the socket and keeps the state; `start()` binds the same port."""

    name = "fake"
    poll_ms = 5

    host = "127.0.0.1"  # a subclass (or instance) set to another address binds it insecurely (a test network)

    def __init__(self, port: int) -> None:
        self.port = port
        self.lock = threading.Lock()  # held while a request is answered: take it to read the records
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> Self:
        server = _bind(self.port, self.name, self.host)
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, args=(server,), daemon=True, name=self.name)
        self._thread.start()
        return self

    def _serve(self, server: Server) -> None:
        try:
            while not self._stop.is_set():
                request = server.poll(timeout_ms=self.poll_ms)
                with self.lock:
                    answers = [] if request is None else self.answer(server, request)
                    answers += self.housekeeping()
                for reply_to, message, payload in answers:
                    server.reply(reply_to, message, payload=payload)
        finally:
            server.close()

    @abstractmethod
    def answer(self, server: Server, request: Any) -> list[tuple[Any, Any, list[Any]]]:
        """The replies (reply_to, message, payload frames) to one request; called under `self.lock`."""

    def housekeeping(self) -> list[tuple[Any, Any, list[Any]]]:
        """Replies due now without a request (held requests); called after every poll."""
        return []

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Self:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _bind(port: int, name: str, host: str = "127.0.0.1") -> Server:
    """Bind, retrying for 10 s while the port is still held by the socket this fake closed a moment ago. Another
    host than loopback is bound insecurely: a test's own network (namespaces it built)."""
    deadline = time.monotonic() + 10
    security = SocketSecurity(insecure=host != "127.0.0.1")
    while True:
        try:
            return Server(host, port, security, name=name)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class _Slot:
    """A prompt of the core's dataset: a place that a test's prompt fills when the core first leases it."""

    def __init__(self, prompt_id: int) -> None:
        self.prompt_id, self.messages, self.metadata = prompt_id, [], {}


class FakeBuffer(ServerThread):
    """The buffer as generators see it, answered by the real `BufferCore`; the test chooses the prompts.

    Leases, deadlines, acks (accepted / duplicate / rejected, with the real checks), lease returns and expiries
    are the core's. The core's dataset is `SLOTS` placeholder prompts in one epoch; a slot takes the next of the
    test's prompts (`add_prompts`, in order) when the core first leases it, and keeps it when the core re-issues
    it. The learner it stands for keeps up: admission never refuses for staleness, and the learner's version
    follows the newest version a generator reports. When no prompt is left to lease, requests are refused with
    `when_empty` ("exhausted": the generator drains and exits; "full": it waits).

    Fault injection: `lease_size` caps every lease; `refusal(request)` may refuse a lease request first;
    `retry_after_s` replaces the retry time of refusals; `stop()` / `start()` take the buffer away and bring it
    back on the same port with its state. Records (read them under `lock` while it runs): leases (lease id ->
    the test's prompts, re-issues included), groups (group id -> first group that was not rejected), arrivals,
    group_times, lease_requests, lease_times, heartbeats, returns, rejected (ErrorReply kinds).
    """

    name = "fake-buffer"
    SLOTS = 1 << 16

    def __init__(
        self,
        config: TandemConfig,
        prompts: Sequence[PromptItem] = (),
        lease_size: int = 2,
        when_empty: str = "exhausted",
    ) -> None:
        super().__init__(config.buffer.port)
        settings = dataclasses.replace(
            BufferSettings.from_config(config), max_staleness=10**9, epochs=1, lease_timeout_s=300.0
        )
        self.core = BufferCore(BufferState(settings, [_Slot(i) for i in range(self.SLOTS)], journal=None))
        self.queue: deque[PromptItem] = deque(prompts)
        self.lease_size, self.when_empty = lease_size, when_empty
        self.refusal: Callable[[LeaseRequest], LeaseRefused | None] | None = None
        self.retry_after_s: float | None = None
        self._prompts: dict[int, PromptItem] = {}  # core slot id -> the test's prompt in it
        self._slots: dict[int, int] = {}  # the test's prompt id -> its slot
        self.leases: dict[int, list[PromptItem]] = {}
        self.groups: dict[tuple[int, int], RolloutGroup] = {}
        self.arrivals: list[tuple[int, int]] = []
        self.group_times: dict[tuple[int, int], float] = {}  # time.time() each group first arrived
        self.lease_requests: list[LeaseRequest] = []
        self.lease_times: list[float] = []  # time.time() of each lease request
        self.heartbeats: list[Heartbeat] = []
        self.returns: list[LeaseReturn] = []
        self.rejected: list[str] = []

    def add_prompts(self, prompts: Sequence[PromptItem]) -> None:
        with self.lock:
            self.queue.extend(prompts)

    def counters(self) -> dict[str, int]:
        """The core's ledger and event counts (arrived, duplicates, leases_expired, ...)."""
        with self.lock:
            return self.core.counters()

    def wait_for_groups(self, count: int, timeout_s: float) -> list[RolloutGroup]:
        def arrived() -> list[RolloutGroup] | None:
            with self.lock:
                return list(self.groups.values()) if len(self.groups) >= count else None

        return wait_until(arrived, timeout_s, f"{count} groups (got {len(self.groups)})")

    # ------------------------------------------------------------------------------------------ answering
    def answer(self, server: Server, request: Any) -> list[tuple[Any, Any, list[Any]]]:
        message = request.message
        if isinstance(message, LeaseRequest):
            self.lease_requests.append(message)
            self.lease_times.append(time.time())
        try:
            reply = self._handle(message, request.sender)
        except RequestRejected as refusal:
            self.rejected.append(refusal.kind)
            server.reject(request, refusal.reason, refusal.kind)
            return []
        return [(request, reply, [])]

    def housekeeping(self) -> list[tuple[Any, Any, list[Any]]]:
        return [(reply_to, message, []) for reply_to, message in self.core.tick(time.time())]

    def _handle(self, message: Any, sender: str) -> Any:
        if isinstance(message, LeaseRequest):
            return self._lease(message, sender)
        if isinstance(message, RolloutGroup):
            return self._group(message, sender)
        if isinstance(message, Heartbeat):
            self.heartbeats.append(message)
            self._follow(message.policy_version)
        elif isinstance(message, LeaseReturn):
            self.returns.append(message)
            message = dataclasses.replace(message, prompt_ids=[self._slots.get(p, -1) for p in message.prompt_ids])
        return self._core(message, sender)

    def _core(self, message: Any, sender: str) -> Any:
        (reply,) = self.core.handle(message, reply_to=None, sender=sender, now=time.time())  # no learner: one reply
        return reply[1]

    def _follow(self, version: int) -> None:
        """The learner stands at the newest version any generator reports (so no version is from the future)."""
        if version > self.core.state.learner_version:  # the state event: no batch is drawn here to report after
            self.core.state.report_version(version, version)

    def _lease(self, request: LeaseRequest, sender: str) -> LeaseGrant | LeaseRefused:
        reply = self.refusal(request) if self.refusal is not None else None
        available = len(self.queue) + self.core.state.dispenser.queued  # new prompts + slots to re-issue
        if reply is None and not available:
            reply = LeaseRefused(self.when_empty, 0, 0.2)
        if reply is None:
            self._follow(request.policy_version)
            capped = dataclasses.replace(request, max_prompts=min(request.max_prompts, self.lease_size, available))
            reply = self._core(capped, sender)
        if isinstance(reply, LeaseGrant):
            prompts = [self._fill(slot.prompt_id) for slot in reply.prompts]
            self.leases.setdefault(reply.lease_id, []).extend(prompts)
            return dataclasses.replace(reply, prompts=prompts)
        if self.retry_after_s is not None:
            reply = dataclasses.replace(reply, retry_after_s=self.retry_after_s)
        return reply

    def _fill(self, slot: int) -> PromptItem:
        if slot not in self._prompts:
            prompt = self.queue.popleft()
            self._prompts[slot], self._slots[prompt.prompt_id] = prompt, slot
        return self._prompts[slot]

    def _group(self, group: RolloutGroup, sender: str) -> GroupAck:
        self.arrivals.append(group.group_id)
        self.group_times.setdefault(group.group_id, time.time())
        self._follow(int(group.versions.max()) if group.size else 0)
        slot = self._slots.get(group.prompt_id, -1)  # -1: a prompt this buffer never leased (the core rejects it)
        ack = self._core(dataclasses.replace(group, prompt_id=slot, epoch=0), sender)
        if ack.status != "rejected":
            self.groups.setdefault(group.group_id, group)
        return dataclasses.replace(ack, prompt_id=group.prompt_id)


# ---------------------------------------------------------------------------------------------------- weights
def pack_weights(
    arrays: Mapping[str, np.ndarray],
    policy_version: int,
    bucket_bytes: int = int(DEFAULT_BUCKET_MB * (1 << 20)),
    dtypes: Mapping[str, str] | None = None,
) -> tuple[WeightsHeader, list[bytearray]]:
    """`arrays` copied into buckets by `common.weights`' layout: the header and the bucket frames.

    `dtypes` names the true dtype of arrays whose numpy dtype only carries their bytes, e.g.
    `{"lm_head.weight": "bfloat16"}` for `tensor.view(torch.uint16).numpy()`; others use `array.dtype.name`.
    Raises ValueError for a non-contiguous array, an unknown dtype name, or an itemsize that does not match it.
    """
    dtypes = dtypes or {}
    for name, array in arrays.items():
        if not array.flags.c_contiguous:
            raise ValueError(f"weights '{name}': array must be C-contiguous (call np.ascontiguousarray first)")
        itemsize = storage_dtype(dtypes.get(name, array.dtype.name)).itemsize
        if itemsize != array.dtype.itemsize:
            raise ValueError(
                f"weights '{name}': dtype '{dtypes.get(name, array.dtype.name)}' needs {itemsize}-byte items, "
                f"the array has {array.dtype.itemsize}-byte {array.dtype}"
            )
    layout = [(name, dtypes.get(name, array.dtype.name), array.shape) for name, array in arrays.items()]
    specs, sizes = plan_buckets(layout, bucket_bytes)
    buckets = [bytearray(size) for size in sizes]
    targets = [np.frombuffer(bucket, dtype=np.uint8) for bucket in buckets]
    for spec in specs:
        targets[spec.bucket][spec.offset : spec.offset + spec.nbytes] = arrays[spec.name].reshape(-1).view(np.uint8)
    return WeightsHeader(policy_version=policy_version, tensors=specs, bucket_sizes=sizes), buckets


def unpack_weights(header: WeightsHeader, buckets: Sequence[Any]) -> Iterator[tuple[TensorSpec, np.ndarray]]:
    """(spec, zero-copy view) per tensor, in the header's order; bfloat16 as uint16 words. Views share the buckets'
    memory (copy before writing). Raises `common.weights.WeightsLayoutError` when the frames do not match."""
    views = check_frames(header, buckets)
    for spec in header.tensors:
        dtype = storage_dtype(spec.dtype)
        array = np.frombuffer(views[spec.bucket], dtype=dtype, count=spec.nbytes // dtype.itemsize, offset=spec.offset)
        yield spec, array.reshape(spec.shape)


class FakePublisher(ServerThread):
    """The learner's weight publisher: answers `WeightsRequest` with the latest published update if it is newer.
    With `hold_s` > 0 it long-polls: a request with nothing newer is held until a version is published (answered
    at once) or `hold_s` passes (`WeightsNotNewer`). Records requests, published_at and sent_at (time.time())."""

    name = "fake-publisher"

    def __init__(self, port: int, bucket_bytes: int = 1 << 20, hold_s: float = 0.0) -> None:
        super().__init__(port)
        self.bucket_bytes, self.hold_s = bucket_bytes, hold_s
        self.latest: tuple[WeightsHeader, list[bytearray]] | None = None
        self.version = 0
        self.requests: list[WeightsRequest] = []
        self.held: list[tuple[Any, float]] = []  # (request, monotonic time it arrived)
        self.published_at: dict[int, float] = {}  # version -> time.time() it became available
        self.sent_at: dict[int, float] = {}  # version -> time.time() it was first sent

    def publish(self, version: int, arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str] | None = None) -> None:
        header, buckets = pack_weights(arrays, version, self.bucket_bytes, dtypes)
        with self.lock:
            self.latest, self.version = (header, buckets), version
            self.published_at[version] = time.time()

    def answer(self, server: Server, request: Any) -> list[tuple[Any, Any, list[Any]]]:
        if not isinstance(request.message, WeightsRequest):
            server.reject(request, f"a publisher takes weights requests, not {type(request.message).__name__}")
            return []
        self.requests.append(request.message)
        if self.hold_s > 0 or self._newer(request):
            self.held.append((request, time.monotonic()))
            return self.housekeeping()
        return [(request, WeightsNotNewer(latest_version=self.version), [])]

    def housekeeping(self) -> list[tuple[Any, Any, list[Any]]]:
        answers, still = [], []
        for request, since in self.held:
            if self._newer(request):
                self.sent_at.setdefault(self.version, time.time())
                answers.append((request, *self.latest))
            elif time.monotonic() - since > self.hold_s:
                answers.append((request, WeightsNotNewer(latest_version=self.version), []))
            else:
                still.append((request, since))
        self.held = still
        return answers

    def _newer(self, request: Any) -> bool:
        return self.latest is not None and self.version > request.message.have_version


class RelayPublisher:
    """The learner's real publisher with the relay transport (learners/publisher.py + learners/fanout.py) behind
    FakePublisher's `publish(version, arrays, dtypes)`: a generator under test receives chunks into a host copy
    that its engine maps, as in production. Long-polls like production; `publisher` is the real object."""

    def __init__(self, port: int, bucket_bytes: int = 1 << 20, fanout: int = 2) -> None:
        from learners.fanout import FanoutTree
        from learners.publisher import DEFAULT_HOLD_S, ZmqWeightsPublisher

        self.publisher = ZmqWeightsPublisher(
            "127.0.0.1", port, SocketSecurity(), bucket_bytes, hold_s=DEFAULT_HOLD_S, relay=FanoutTree(fanout, 1)
        )
        self.published_at: dict[int, float] = {}  # version -> time.time() it became available

    def start(self) -> Self:
        return self

    def publish(self, version: int, arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str] | None = None) -> None:
        dtypes = dtypes or {}
        layout = [(name, dtypes.get(name, str(a.dtype)), list(a.shape)) for name, a in arrays.items()]
        self.published_at[version] = time.time()
        self.publisher.publish(version, layout, list(arrays.items()))

    def stop(self) -> None:
        self.publisher.close()
