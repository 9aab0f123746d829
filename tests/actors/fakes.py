"""Fakes that play the generator's peers over real loopback sockets: a buffer and a weight publisher.

    buffer = FakeBuffer(port, prompts, lease_size=2).start()
    ...
    buffer.stop(); buffer.start()          # the buffer goes away and comes back on the same port, state kept
    publisher = FakePublisher(port).start(); publisher.publish(version, arrays, dtypes)

Each runs a real `common.sockets.Server` in a thread; everything they receive is recorded for the test to inspect.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from common.sockets import Server, SocketSecurity
from common.types import (
    GroupAck,
    Heartbeat,
    LeaseGrant,
    LeaseRefused,
    LeaseRequest,
    LeaseReturn,
    Ok,
    PromptItem,
    RolloutGroup,
    WeightsHeader,
    WeightsNotNewer,
    WeightsRequest,
)
from common.weights import pack_weights

REPO = Path(__file__).resolve().parents[2]


def arithmetic_items(count: int, explode_every: int = 0, first_id: int = 0) -> list[PromptItem]:
    """Prompts like the buffer leases; every `explode_every`-th one asks the test reward function to raise."""
    items = []
    for i in range(first_id, first_id + count):
        metadata: dict[str, Any] = {"answer": 2 * i, "explode": bool(explode_every and i % explode_every == 0)}
        messages = [{"role": "user", "content": f"What is {i} + {i}?"}]
        items.append(PromptItem(prompt_id=i, epoch=0, messages=messages, metadata=metadata))
    return items


class _ServerThread:
    """A `Server` polled in a daemon thread; `handle(request)` answers each request. stop()/start() rebind."""

    name = "fake"

    def __init__(self, port: int) -> None:
        self.port = port
        self.lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.deferred: list[tuple[Any, float]] = []  # (request, monotonic time it arrived)

    def start(self) -> Any:
        server = _bind(self.port, self.name)
        self._stop.clear()
        self._thread = threading.Thread(target=self._serve, args=(server,), daemon=True, name=self.name)
        self._thread.start()
        return self

    def _serve(self, server: Server) -> None:
        try:
            while not self._stop.is_set():
                request = server.poll(timeout_ms=5)
                with self.lock:
                    if request is not None:
                        answer = self.handle(request.message)
                        if answer is None:
                            self.deferred.append((request, time.monotonic()))
                        else:
                            server.reply(request, *answer)
                    for request, answer in self.answer_deferred():
                        server.reply(request, *answer)
        finally:
            server.close()

    def handle(self, message: Any) -> tuple[Any, list[Any]] | None:
        """(reply, payload frames), or None to answer later from `answer_deferred`."""
        raise NotImplementedError

    def answer_deferred(self) -> list[tuple[Any, tuple[Any, list[Any]]]]:
        return []

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def _bind(port: int, name: str) -> Server:
    deadline = time.monotonic() + 10
    while True:
        try:
            return Server("127.0.0.1", port, SocketSecurity(), name=name)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class FakeBuffer(_ServerThread):
    """Leases `prompts` in order, `lease_size` at a time (or refuses: see `refusal`), acknowledges groups
    ('duplicate' for a group id seen before) and records heartbeats and lease returns. When the prompts run out it
    refuses with `when_empty` ('exhausted' by default, or 'full' to keep a generator waiting)."""

    name = "fake-buffer"

    def __init__(
        self, port: int, prompts: list[PromptItem], lease_size: int = 2, when_empty: str = "exhausted"
    ) -> None:
        super().__init__(port)
        self.queue: deque[PromptItem] = deque(prompts)
        self.lease_size = lease_size
        self.when_empty = when_empty
        self.refusal: Callable[[LeaseRequest], LeaseRefused | None] | None = None
        self.retry_after_s = 0.2
        self.next_lease_id = 1
        self.leases: dict[int, list[PromptItem]] = {}
        self.groups: dict[tuple[int, int], RolloutGroup] = {}
        self.arrivals: list[tuple[int, int]] = []
        self.lease_requests: list[LeaseRequest] = []
        self.lease_times: list[float] = []  # time.time() of each lease request
        self.group_times: dict[tuple[int, int], float] = {}  # time.time() each group first arrived
        self.heartbeats: list[Heartbeat] = []
        self.returns: list[LeaseReturn] = []

    def add_prompts(self, prompts: list[PromptItem]) -> None:
        with self.lock:
            self.queue.extend(prompts)

    def handle(self, message: Any) -> tuple[Any, list[Any]]:
        if isinstance(message, LeaseRequest):
            self.lease_requests.append(message)
            self.lease_times.append(time.time())
            refused = self.refusal(message) if self.refusal is not None else None
            if refused is not None:
                return refused, []
            if not self.queue:
                return LeaseRefused(self.when_empty, 0, self.retry_after_s), []
            count = min(message.max_prompts, self.lease_size, len(self.queue))
            prompts = [self.queue.popleft() for _ in range(count)]
            lease_id, self.next_lease_id = self.next_lease_id, self.next_lease_id + 1
            self.leases[lease_id] = prompts
            return LeaseGrant(lease_id=lease_id, deadline=time.time() + 300, prompts=prompts), []
        if isinstance(message, RolloutGroup):
            self.arrivals.append(message.group_id)
            self.group_times.setdefault(message.group_id, time.time())
            status = "duplicate" if message.group_id in self.groups else "accepted"
            self.groups.setdefault(message.group_id, message)
            return GroupAck(message.lease_id, message.prompt_id, status), []
        if isinstance(message, Heartbeat):
            self.heartbeats.append(message)
            return Ok(learner_version=0), []
        if isinstance(message, LeaseReturn):
            self.returns.append(message)
            return Ok(learner_version=0), []
        raise AssertionError(f"fake buffer got an unexpected {type(message).__name__}")

    def wait_for_groups(self, count: int, timeout_s: float) -> list[RolloutGroup]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.groups) >= count:
                    return list(self.groups.values())
            time.sleep(0.05)
        raise AssertionError(f"{len(self.groups)} groups arrived within {timeout_s}s, expected {count}")


class FakePublisher(_ServerThread):
    """The learner's weight publisher: answers `WeightsRequest` with the latest published update if newer.
    With `hold_s` > 0 it long-polls: a request with nothing newer is held until a version is published (answered
    at once) or `hold_s` passes (`WeightsNotNewer`)."""

    name = "fake-publisher"

    def __init__(self, port: int, bucket_bytes: int = 1 << 20, hold_s: float = 0.0) -> None:
        super().__init__(port)
        self.bucket_bytes = bucket_bytes
        self.hold_s = hold_s
        self.latest: tuple[WeightsHeader, list[bytearray]] | None = None
        self.version = 0
        self.requests: list[WeightsRequest] = []
        self.published_at: dict[int, float] = {}  # version -> time.time() it became available
        self.sent_at: dict[int, float] = {}  # version -> time.time() it was first sent

    def publish(self, version: int, arrays: dict[str, np.ndarray], dtypes: dict[str, str] | None = None) -> None:
        header, buckets = pack_weights(arrays, version, self.bucket_bytes, dtypes)
        with self.lock:
            self.latest, self.version = (header, buckets), version
            self.published_at[version] = time.time()

    def handle(self, message: Any) -> tuple[Any, list[Any]] | None:
        assert isinstance(message, WeightsRequest), type(message)
        self.requests.append(message)
        if self.latest is not None and self.version > message.have_version:
            return self._send_latest()
        return None if self.hold_s > 0 else (WeightsNotNewer(latest_version=self.version), [])

    def _send_latest(self) -> tuple[Any, list[Any]]:
        self.sent_at.setdefault(self.version, time.time())
        return self.latest

    def answer_deferred(self) -> list[tuple[Any, tuple[Any, list[Any]]]]:
        answers, still = [], []
        for request, since in self.deferred:
            if self.latest is not None and self.version > request.message.have_version:
                answers.append((request, self._send_latest()))
            elif time.monotonic() - since > self.hold_s:
                answers.append((request, (WeightsNotNewer(latest_version=self.version), [])))
            else:
                still.append((request, since))
        self.deferred = still
        return answers


@contextmanager
def running_peers(ports: tuple[int, int], prompts: list[PromptItem]) -> Iterator[tuple[FakeBuffer, FakePublisher]]:
    """A started FakeBuffer leasing `prompts` two at a time and a FakePublisher, on `ports`; stopped on exit."""
    buffer = FakeBuffer(ports[0], prompts, lease_size=2).start()
    publisher = FakePublisher(ports[1]).start()
    try:
        yield buffer, publisher
    finally:
        buffer.stop()
        publisher.stop()


def write_config(path: Path, run_root: Path, buffer_port: int, weights_port: int, **sections: dict[str, Any]) -> Path:
    """A TOML run config whose buffer and publisher addresses are these loopback ports, plus `sections`."""
    base: dict[str, dict[str, Any]] = {
        "run": {"name": "gen", "root": str(run_root)},
        "buffer": {"host": "127.0.0.1", "port": buffer_port},
        "learner": {
            "weights_host": "127.0.0.1",
            "weights_port": weights_port,
            "buffer_address": f"127.0.0.1:{buffer_port}",
        },
        "generator": {
            "buffer_address": f"127.0.0.1:{buffer_port}",
            "weights_address": f"127.0.0.1:{weights_port}",
            "reconnect_max_s": 0.5,
        },
    }
    for section, values in sections.items():
        base.setdefault(section, {}).update(values)
    lines = []
    for section, values in base.items():
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml(value)}" for key, value in values.items())
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def generator_command(config_path: Path, index: int = 0) -> list[str]:
    return [sys.executable, "-m", "launch.cli", "generator", str(config_path), "--generator.index", str(index)]
