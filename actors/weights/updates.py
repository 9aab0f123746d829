"""New weights for a generator: where they come from (`WeightsSource`), when to ask (`WeightsPoller`), and how they
are handed to vLLM's worker processes (`SharedMemoryStaging`).

    source = open_weights_source(config.weights, address, security, generator_id, weights_store_dir(run_dir))
    poller = WeightsPoller(source, poll_s=1.0, backoff_max_s=10.0)
    update = poller.poll(time.monotonic(), engine.policy_version)   # never blocks; None: nothing (yet)
    if update is not None:
        engine.load_weights(update, inflight=False)

Transport. `WeightsSource.fetch` is the seam, one source per `weights.transport`:
  * relay (default, `actors.weights.relay.RelayWeightsSource`): the publisher names a parent (itself for k generators,
    else a generator holding or receiving the version, or this host's receiver); chunks are checked against the
    publisher's digests, forwarded to this generator's children, and land in a shared-memory host copy that the
    engine maps (`WeightsUpdate.staged`). A star reply (the whole update as payload) is taken as well.
  * star (`ZmqWeightsSource`): the whole update from the publisher (`WeightsRequest` -> `WeightsHeader` + bucket
    frames laid out by `common.weights`, or `WeightsNotNewer`); a header announcing another transport is refused
    with `WeightsTransportError` rather than misread.
  * broadcast (`actors.weights.broadcast_source`): a collective group of the generators ready for each round (gloo on
    CPU, NCCL on GPUs), received inside vLLM's workers.

Failure modes: an unreachable publisher is not an error for the generator (it keeps sampling with the weights it
has and asks again after a back-off); a malformed reply raises `WeightsTransportError`, which the poller counts,
logs and retries like an unreachable publisher. Malformed means anything `common.weights.check_frames` refuses
(an unknown dtype, sizes or shapes that disagree with the bytes, bucket indices out of range, empty or repeated
names) and an update whose tensor layout (names, dtypes, shapes) differs from the first one this source accepted
(one floating dtype for another is no change: the engine casts an update into its own dtype, `LayoutGuard`).

Adapter-only updates (learner.lora.sync = "adapter": `WeightsHeader.lora_rank` > 0) travel the same way; their
tensors are checked as LoRA matrices (`common.weights.check_adapter`, a malformed one is a bad reply), and an engine
that is sent the wrong kind (full vs adapter, `check_update_kind`) raises `WeightsRejected`, which the generator hands
to `WeightsPoller.reject`: counted (`rejected_update`), asked for again after the back-off, never fatal.

Versions are bounded too, since a forged version would stall a generator for good (it would wait for the learner
to pass it): `WeightsPoller` never adopts a version more than `max_version_lead` ahead of what it knows the
learner reached (the version it has, or the one the buffer asked for with `want`); such a reply is counted
(`implausible_version`) and asked again. And when the publisher says its latest version is older than the one
the generator holds (a version the learner never published, or a learner resumed from an older checkpoint),
the poller counts it (`version_regressed`) and fetches the publisher's latest whatever its number, so the
generator returns to the learner's real weights at the next poll.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from common.config import WeightsConfig
from common.sockets import Client, PeerUnavailable, SocketSecurity, backoff_delays
from common.types import ErrorReply
from common.weight_messages import WeightsHeader, WeightsNotNewer, WeightsRequest
from common.weights import (  # noqa: F401 - shared_memory_dir, weights_store_dir: this module's API too
    ALIGN,
    WeightsLayoutError,
    check_frames,
    room_for,
    shared_memory_dir,
    total_bytes,
    weights_store_dir,
)
from common.wire import WireError

log = logging.getLogger("tandem.actors.weights")

# The most versions an update may lead what the learner is known to have reached (see the module docstring).
# Versions are optimizer steps: 10^4 is hours of training past anything the buffer asked for, while a legitimate
# lead is the staleness bound plus one sync (a restarted generator at v0 is told the learner's version by the
# buffer's "stale" refusal, and is then in bound).
MAX_VERSION_LEAD = 10_000


class WeightsTransportError(RuntimeError):
    """The publisher's reply cannot be used (refused request, malformed frames, unsupported transport)."""


class WeightsRejected(ValueError):
    """An engine refused a well-formed update before changing anything: a full update to an engine serving
    adapters or the reverse, an adapter of a higher rank than the engine serves, or an adapter vLLM cannot load
    (its modules are not the model's). The generator counts it (`WeightsPoller.reject`) and keeps its weights."""


def check_update_kind(header: WeightsHeader, max_lora_rank: int) -> None:
    """Raise `WeightsRejected` unless `header` is the kind of update an engine started with `max_lora_rank`
    serves: full weights (lora_rank 0) when it is 0, else an adapter of rank 1 to `max_lora_rank`."""
    version, rank = header.policy_version, header.lora_rank
    if max_lora_rank == 0 and rank > 0:
        raise WeightsRejected(
            f"weights v{version} is an adapter-only update (rank {rank}) and this engine loads full weights: "
            'the learner and the generators must share learner.lora.sync = "adapter"'
        )
    if max_lora_rank > 0 and rank == 0:
        raise WeightsRejected(
            f"weights v{version} is a full-weights update and this engine serves LoRA adapters only: the learner "
            'and the generators must share learner.lora.sync = "adapter"'
        )
    if rank > max_lora_rank:
        raise WeightsRejected(f"weights v{version}: adapter rank {rank} is over this engine's {max_lora_rank}")


@dataclass
class WeightsUpdate:
    """A received weights update: header + bucket frames (layout: `common.weights`). `received_at` is the
    monotonic time the reply arrived (the start of the weight-sync latency the generator controls)."""

    header: WeightsHeader
    buckets: list[memoryview]
    received_at: float
    # Where the bytes already lie in a shared-memory file that vLLM's workers can map (a host copy), with each
    # tensor's (name, dtype name, shape, byte offset in the file, nbytes): then no staging copy is needed.
    staged: tuple[Path, list[tuple[str, str, list[int], int, int]]] | None = None
    keep: Any = None  # what the buckets' memory and `staged` need alive (a relay's host copy)

    @property
    def policy_version(self) -> int:
        return self.header.policy_version

    @property
    def nbytes(self) -> int:
        return total_bytes(self.header)


class WeightsSource(Protocol):
    """Where weights come from. `fetch` returns an update newer than `have_version`, or the latest version the
    source knows when nothing is newer. Raises `PeerUnavailable` (source unreachable) or
    `WeightsTransportError` (unusable reply)."""

    def fetch(self, have_version: int) -> WeightsUpdate | int: ...

    def close(self) -> None: ...


def ask_publisher(
    client: Client, request: WeightsRequest, timeout_s: float, transports: tuple[str, ...], who: str
) -> int | tuple[WeightsHeader, list[memoryview]]:
    """One `WeightsRequest` to `who` (the publisher, a doorbell): the latest version when nothing is newer, else a
    header of one of `transports` and its payload. Raises `WeightsTransportError` for a malformed reply, a refusal,
    or a header of another transport; `PeerUnavailable` when nothing answers."""
    try:
        reply, payload = client.request(request, timeout_s=timeout_s)
    except WireError as error:
        client.reset()
        raise WeightsTransportError(f"malformed reply from {who}: {error.reason}") from None
    if isinstance(reply, WeightsNotNewer):
        return reply.latest_version
    if isinstance(reply, ErrorReply):
        raise WeightsTransportError(f"{who} refused the request: {reply.reason}")
    if not isinstance(reply, WeightsHeader):
        raise WeightsTransportError(f"{who} answered {type(reply).__name__}, not weights")
    if reply.transport not in transports:
        raise WeightsTransportError(
            f"{who} announced transport '{reply.transport}' and this source receives {' or '.join(transports)}: "
            "set weights.transport to the publisher's"
        )
    return reply, payload


FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16"})


class LayoutGuard:
    """The tensor layout (names, dtypes, shapes) of the first update a source accepted, one per kind (full weights,
    adapter-only: a full update the engine then refuses must not bar the adapters that follow): `check` refuses an
    update of a known kind with another layout (a different model) with `WeightsTransportError`. One floating
    dtype standing for another is the same layout: a learner restarted on a machine where `model.dtype = "auto"`
    chose otherwise publishes the same model in another dtype, and the engine casts every tensor into its own
    (actors/engine/vllm.py)."""

    def __init__(self) -> None:
        self.layouts: dict[bool, list[tuple[str, str, list[int]]]] = {}  # adapter-only? -> layout

    def check(self, header: WeightsHeader) -> None:
        layout = [
            (spec.name, "float" if spec.dtype in FLOAT_DTYPES else spec.dtype, list(spec.shape))
            for spec in header.tensors
        ]
        known = self.layouts.setdefault(header.lora_rank > 0, layout)
        if layout != known:
            changed = next((new[0] for new, old in zip(layout, known) if new != old), "the tensor count")
            raise WeightsTransportError(
                f"weights update v{header.policy_version} changes the model's layout ({changed})"
            )


class ZmqWeightsSource:
    """Pulls whole updates from the learner's publisher over a ZeroMQ request (weights.transport = 'star')."""

    def __init__(self, address: str, security: SocketSecurity, generator_id: int, timeout_s: float = 120.0) -> None:
        self.client = Client(address, security, identity=f"generator-{generator_id}-weights", role="generator")
        self.generator_id = generator_id
        self.timeout_s = timeout_s
        self.layout = LayoutGuard()

    def fetch(self, have_version: int) -> WeightsUpdate | int:
        request = WeightsRequest(generator_id=self.generator_id, have_version=have_version)
        reply = ask_publisher(self.client, request, self.timeout_s, ("zmq",), "the weight publisher")
        if isinstance(reply, int):
            return reply
        header, payload = reply
        try:
            buckets = check_frames(header, payload)
        except WeightsLayoutError as error:
            raise WeightsTransportError(f"malformed weights update: {error}") from None
        self.layout.check(header)
        return WeightsUpdate(header, buckets, received_at=time.monotonic())

    def close(self) -> None:
        self.client.close()


def open_weights_source(
    weights: WeightsConfig,
    address: str,
    security: SocketSecurity,
    generator_id: int,
    store_dir: Path,
    workers: int = 1,
) -> WeightsSource:
    """The generator's source for `weights.transport`: 'star' pulls whole updates from the publisher; 'relay'
    (`actors.weights.relay`) pulls chunks from the parent the publisher names and shares one copy per host in
    `store_dir`; 'broadcast' (`actors.weights.broadcast_source`) announces rounds that the engine's `workers` (its
    tensor-parallel size) receive in the group. Raises ValueError for a configuration that cannot work."""
    if weights.transport == "star":
        return ZmqWeightsSource(address, security, generator_id)
    if weights.transport == "relay":
        from actors.weights.relay import RelayWeightsSource  # here: actors.weights.relay builds on this module

        return RelayWeightsSource(address, security, generator_id, weights, store_dir)
    if weights.transport == "broadcast":
        from actors.weights.broadcast_source import open_broadcast_source  # here: it builds on this module too

        return open_broadcast_source(weights, address, security, generator_id, workers)
    raise ValueError(f"weights.transport '{weights.transport}' cannot be received by this build")


def relay_metrics(source: WeightsSource) -> dict[str, float]:
    """The relay's figures for the generator's metrics (none for another transport): the last update's receive
    seconds and depth (hops from the publisher), and re-attachments and bad chunks so far."""
    last = getattr(source, "last_receive", None)
    if not last:
        return {}
    counters = source.counters  # type: ignore[attr-defined]
    return {
        "actor/weight_receive_s": float(last["seconds"]),
        "actor/weight_depth": float(last["depth"]),
        "actor/weight_reattachments": float(counters["reattachments"]),
        "actor/weight_bad_chunks": float(counters["bad_chunks"]),
        "actor/weight_host_copies_mapped": float(counters["host_copies_mapped"]),
        "actor/relay_rejected": float(sum(source.relay.rejected.values())),  # type: ignore[attr-defined]
    }


class WeightsPoller:
    """Decides when to ask the source for weights, and asks in a background thread, so that a slow transfer or an
    unreachable publisher never stalls the generator's loop (one fetch at a time).

    Ordering: a fetch starts every `poll_s`; `want(v)` (the buffer refused a lease as stale, or admission is full)
    makes the next fetch start at once and keeps fetching every `WAITING_POLL_S` until a version >= v arrives.
    An unreachable source or an unusable reply is counted in `failures` (by kind), logged, and retried after
    `backoff_delays(backoff_max_s)`. Versions: see the module docstring (`max_version_lead`, rollback).
    """

    WAITING_POLL_S = 0.2

    def __init__(
        self, source: WeightsSource, poll_s: float, backoff_max_s: float, max_version_lead: int = MAX_VERSION_LEAD
    ) -> None:
        self.source = source
        self.poll_s = poll_s
        self.backoff_max_s = backoff_max_s
        self.max_version_lead = max_version_lead
        self.next_poll = 0.0
        self.min_version = -1  # a version the buffer requires (-1 = none)
        self.latest_seen = -1  # the newest (plausible) version the source reported
        self.failures: Counter[str] = Counter()
        self._delays = backoff_delays(backoff_max_s)
        self._fetch: _Fetch | None = None
        self._rollback = False  # the source is behind what we hold: fetch its latest, whatever its version

    def want(self, min_version: int) -> None:
        """Fetch until the generator has `min_version`; the next fetch starts at once."""
        self.min_version = max(self.min_version, min_version)
        self.next_poll = 0.0

    def poll(self, now: float, have_version: int) -> WeightsUpdate | None:
        """Non-blocking: starts a fetch when one is due; returns the update of a finished fetch when it is newer
        than `have_version` (or the publisher's latest after a rollback, see the module docstring), else None."""
        if self._fetch is None:
            if now >= self.next_poll:
                self._fetch = _Fetch(self.source, -1 if self._rollback else have_version)
            return None
        if not self._fetch.finished.is_set():
            return None
        fetch, self._fetch = self._fetch, None
        return self._settle(fetch, have_version)

    def wait(self, have_version: int, timeout_s: float) -> WeightsUpdate | None:
        """Blocking: fetch now and wait up to `timeout_s` (a fetch still running is collected by a later `poll`)."""
        if self._fetch is None:
            self._fetch = _Fetch(self.source, -1 if self._rollback else have_version)
        if not self._fetch.finished.wait(timeout_s):
            return None
        fetch, self._fetch = self._fetch, None
        return self._settle(fetch, have_version)

    def idle_wait(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s` (the loop has nothing to step), waking the moment a running fetch finishes, so a
        received update is loaded at once rather than after the rest of the sleep."""
        fetch = self._fetch
        if fetch is not None and not fetch.finished.is_set():
            fetch.finished.wait(timeout_s)
        else:  # no fetch, or one finished that the loop does not collect now (draining): a plain sleep, no spin
            time.sleep(timeout_s)

    def _settle(self, fetch: _Fetch, have_version: int) -> WeightsUpdate | None:
        if fetch.error is not None:
            if not isinstance(fetch.error, (PeerUnavailable, WeightsTransportError)):
                raise fetch.error
            kind = "unreachable" if isinstance(fetch.error, PeerUnavailable) else "bad_reply"
            self._retry_later(kind, str(fetch.error))
            return None
        result = fetch.result
        latest = result.policy_version if isinstance(result, WeightsUpdate) else int(result)
        known = max(have_version, self.min_version)  # what the learner is known to have reached
        if latest > max(known, 0) + self.max_version_lead:
            reason = f"the publisher announced v{latest}, over {self.max_version_lead} past v{known}: not adopted"
            self._retry_later("implausible_version", reason)
            return None
        self._delays = backoff_delays(self.backoff_max_s)
        self.latest_seen = max(self.latest_seen, latest)
        if 0 <= latest < have_version and not isinstance(result, WeightsUpdate):
            self.failures["version_regressed"] += 1
            log.warning(
                "weights: the publisher is at v%d, behind v%d held here: fetching v%d", latest, have_version, latest
            )
            self._rollback, self.next_poll = True, 0.0
            return None
        waiting = self.min_version > max(have_version, latest)  # the learner has not published it yet
        self.next_poll = time.monotonic() + (self.WAITING_POLL_S if waiting else self.poll_s)
        if isinstance(result, WeightsUpdate) and (result.policy_version > have_version or self._rollback):
            self._rollback = False
            return result
        return None

    def reject(self, update: WeightsUpdate, error: WeightsRejected) -> None:
        """The engine refused `update` (`WeightsRejected`): counted as "rejected_update", logged, and asked for
        again after the back-off (the generator samples on with the weights it has)."""
        self._retry_later("rejected_update", f"v{update.policy_version} not loaded: {error}")

    def _retry_later(self, kind: str, reason: str) -> None:
        self.failures[kind] += 1
        delay = next(self._delays)
        log.warning("weights: %s (%s); asking again in %.1fs", reason, kind, delay)
        self.next_poll = time.monotonic() + delay

    def close(self) -> None:
        """Close the source unless a fetch still uses it (its daemon thread ends with the process)."""
        if self._fetch is None or self._fetch.finished.is_set():
            self.source.close()


class _Fetch:
    """One `source.fetch` running in a daemon thread; `finished` is set when `result` or `error` is there."""

    def __init__(self, source: WeightsSource, have_version: int) -> None:
        self.result: WeightsUpdate | int | None = None
        self.error: Exception | None = None
        self.finished = threading.Event()
        threading.Thread(target=self._run, args=(source, have_version), name="weights-fetch", daemon=True).start()

    def _run(self, source: WeightsSource, have_version: int) -> None:
        try:
            self.result = source.fetch(have_version)
        except Exception as error:  # noqa: BLE001 - handed to the loop's thread: survived if a transport fault, else re-raised
            self.error = error
        finally:
            self.finished.set()


class SharedMemoryStaging:
    """One file in shared memory that carries every weights update to vLLM's worker processes.

    `write(update)` lays the buckets out in the file, each at an `ALIGN`-aligned offset so every tensor keeps its
    alignment, and returns where each tensor lies: (name, dtype name, shape, byte offset, nbytes), in the
    publisher's order. The file is reused and kept mapped, so after the first update its pages exist and a write
    is one plain memcpy into them (40% faster than `pwrite` into tmpfs, which copies page by page).
    Room: before the file grows, its file system is checked for the bytes (`common.weights.room_for`); a /dev/shm
    too small for them (a container's 64 MiB) moves the file to the temporary directory, said once, and no room
    anywhere raises OSError, instead of SIGBUS at the first write past the end. So `path` is known after a write:
    `stage(update)` gives both.
    Ordering: the next `write` may start only after the workers finished reading the previous one (the engine
    loads synchronously). `close()` deletes the file.
    """

    def __init__(self, directory: Path | None = None) -> None:
        fd, name = tempfile.mkstemp(prefix=f"tandem-weights-{os.getpid()}-", dir=directory or shared_memory_dir())
        self.fd = fd
        self.path = Path(name)
        self.size = 0
        self._mapped: mmap.mmap | None = None  # the whole file, shared (what the workers map sees these bytes)

    def stage(self, update: WeightsUpdate) -> tuple[Path, list[tuple[str, str, list[int], int, int]]]:
        """`write(update)`, then the file it lies in (the write may have moved it: see the class docstring)."""
        tensors = self.write(update)
        return self.path, tensors

    def write(self, update: WeightsUpdate) -> list[tuple[str, str, list[int], int, int]]:
        starts, position = [], 0
        for bucket in update.buckets:
            position += (-position) % ALIGN
            starts.append(position)
            position += bucket.nbytes
        if position != self.size:
            self._unmap()
            if position > self.size:
                self._make_room(position)
            os.ftruncate(self.fd, position)
            self.size = position
        if self._mapped is None and position > 0:
            self._mapped = mmap.mmap(self.fd, position)
        for start, bucket in zip(starts, update.buckets):
            if bucket.nbytes:
                self._mapped[start : start + bucket.nbytes] = bucket  # type: ignore[index]
        return [
            (spec.name, spec.dtype, list(spec.shape), starts[spec.bucket] + spec.offset, spec.nbytes)
            for spec in update.header.tensors
        ]

    def _make_room(self, size: int) -> None:
        """Move the (unmapped) file, empty, to where `size` bytes fit, unless they fit where it is (its own bytes
        count as room: they are overwritten). OSError when they fit nowhere (room_for)."""
        directory = room_for(self.path.parent, size, held_bytes=self.size)
        if directory != self.path.parent:
            self.close()
            directory.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix=f"tandem-weights-{os.getpid()}-", dir=directory)
            self.fd, self.path, self.size = fd, Path(name), 0

    def _unmap(self) -> None:
        mapped, self._mapped = self._mapped, None
        if mapped is not None:
            mapped.close()

    def close(self) -> None:
        self._unmap()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)
