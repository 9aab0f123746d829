"""Weight publishing: rank 0 copies the full weights into a host snapshot; a background thread serves it.

    publisher = ZmqWeightsPublisher(host, port, security)              # binds now; serves from a thread
    seconds = publisher.publish(version, trainer.weight_layout(), trainer.full_weights())
    ...                                                                 # generators: WeightsRequest(have_version)
    publisher.close()

Protocol (layout in `common.weights`): a `WeightsRequest(have_version)` is answered with the latest snapshot,
`WeightsHeader` + bucket frames as payload, when its version is newer than `have_version`, else with
`WeightsNotNewer(latest_version)` (-1 before the first publish). Any other message is rejected (counted), and so is a request from a peer of another role than `WEIGHTS_READERS`
(the role its CURVE key proves, or the one it declared on loopback without keys: `common.sockets`).

Invariants:
  * A snapshot is never written while it can be read: `publish` copies (the gather + one copy per tensor,
    straight into its slot) into buckets no reply can reach, then swaps the latest-snapshot reference under
    a lock. Buckets are double-buffered: those of the previous snapshot are reused once it is retired, no
    serving thread holds it (`readers`) and no reply is in flight (a zero-copy frame holds a reference to
    its buffer until ZeroMQ has sent it: CPython's reference count says when); otherwise fresh memory is
    allocated. Warm buffers matter: a copy into fresh pages costs several times a copy into reused ones
    (page faults; benchmarks/learner_throughput.py measures both).
  * The training loop is blocked for the gather + copy only; serving runs on the publisher's thread.
  * Tensor names are the Hugging Face state-dict names, dtypes the training dtype (bfloat16 travels as
    raw 2-byte words): what vLLM's `load_weights` expects.

Hostile readers (a peer that asks for weights and then stops reading them): replies go out zero-copy, so a reply
that ZeroMQ has not finished sending keeps its snapshot's buckets alive. Bounds, all enforced by the serving thread:
  * one reply in flight per connection: a connection's next request waits until ZeroMQ let go of its previous
    reply (only its newest waiting request is kept; the older one is counted `requests_superseded`);
  * at most `max_readers` replies in flight: a request beyond them is refused (`ErrorReply`, counted busy); the
    generator counts it and asks again after its back-off;
  * a reply still in flight after `reader_deadline_s` gets its reader dropped (`dropped_readers/slow`), and while
    more than `max_snapshots` snapshots are alive the readers of the oldest ones are dropped at once
    (`dropped_readers/superseded`). Dropping shuts the reader's TCP connection down (the descriptor its request
    came on, checked against the peer address seen then): ZeroMQ closes it and frees what it held. An honest
    generator that is dropped gets no reply: its request times out (`ZmqWeightsSource.timeout_s`), it asks
    again on a new connection and is sent the newest version.
So at most `max_snapshots` snapshots are alive, plus the one `publish` is writing until the serving thread next
looks (every `poll_ms`), and no slow reader holds memory longer than `reader_deadline_s` (+ `poll_ms`).
`live_bucket_bytes()` reports what is allocated (weak references: it counts what ZeroMQ still holds too).

Transports (`open_weights_publisher`, from `weights.transport`):
  * relay (default): a `WeightsRequest` that names a relay address or host is answered with the relay header only
    (the layout, each chunk's sha256, computed at publish, and the parent `learners.fanout.FanoutTree` assigns);
    the k generators whose parent is the publisher then pull `ChunkRequest`s from it. The publisher's bytes per
    update are k x the model whatever the fleet (`bytes_by_version`). A request without relay fields (a reader
    that speaks only the star) gets the whole snapshot.
  * star: every reader gets the whole snapshot (bytes per update = readers x the model).
  * broadcast: `learners/broadcast_publisher.py` (a collective per update to the generators ready for it: gloo
    on CPU, NCCL on GPUs).
Both ZeroMQ transports long-poll in production (`hold_s`): a request with nothing newer is answered at the next
publish (within `poll_ms`) or with `WeightsNotNewer` after `hold_s`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from common.config import LoraConfig, WeightsConfig
from common.connections import disconnect_tcp, tcp_connection
from common.serving import answer_safely, supervised_thread
from common.sockets import Request, Server, SocketSecurity
from common.weight_messages import ChunkReply, ChunkRequest, ChunkUnavailable, WeightsNotNewer, WeightsRequest
from common.weights import ALIGN, DEFAULT_BUCKET_MB, chunk_ranges, digest_chunks
from learners.fanout import FanoutTree, MembershipRefused
from learners.snapshot import Layout, Snapshot, buckets_reusable, copy_into_snapshot, needs_digests

log = logging.getLogger("tandem.learner.publisher")
WEIGHTS_READERS = ("generator", "eval")  # the roles that sample with the policy (common.keys.ROLES)

DEFAULT_READER_DEADLINE_S = 60.0  # one reply: ~270 MB take < 1 s on loopback, 15 GB ~ 15 s on 10 GbE
DEFAULT_MAX_READERS = 64  # replies in flight at once (generators fetching together)
DEFAULT_MAX_SNAPSHOTS = 3  # the latest, the retired one (reused), one older that a reader may finish
DEFAULT_HOLD_S = 30.0  # a request with nothing newer waits this long for a publish (a long poll); 0 = answer at once
MAX_REPLY_BYTES = 16 << 20  # chunks in one relay reply, at most (at least one chunk; see actors.weights.relay)
KEEP_BYTE_COUNTS = 16  # versions whose bytes out are kept in `bytes_by_version`


class WeightsPublisher(Protocol):
    """What the learner's loop needs from a weight transport."""

    def publish(self, version: int, layout: Layout, weights: Iterable[tuple[str, Any]]) -> float:
        """Make `weights` (consumed in `layout` order) the latest version; returns the seconds it blocked."""
        ...

    def close(self) -> None: ...


class _Reader:
    """A connection with a weights reply in flight. ZeroMQ holds the reply's bucket views until it has sent them:
    when every view is gone, nothing of the reply is left (`done`). `dropped` says why it was disconnected."""

    def __init__(self, snapshot: Snapshot, frames: list[np.ndarray], sent_at: float, peer_fd: int) -> None:
        self.snapshot = snapshot
        self.frames = [weakref.ref(frame) for frame in frames]
        self.sent_at = sent_at
        self.connection = tcp_connection(peer_fd)
        self.dropped = ""

    def done(self) -> bool:
        return all(frame() is None for frame in self.frames)


class ZmqWeightsPublisher:
    """Serves the latest `Snapshot` over a `Server` (ROUTER) socket from a daemon thread (see module docstring).

    Readers (peers with a reply in flight) are bounded, see "Hostile readers" in the module docstring:
    `reader_deadline_s` (the most seconds one reply may take), `max_readers` (replies in flight at once) and
    `max_snapshots` (snapshots alive at once: the latest, the retired one kept for reuse, and older ones that
    slow readers still hold). Raises OSError from the constructor when the port cannot be bound, ValueError for
    limits that cannot hold.
    """

    def __init__(
        self,
        host: str,
        port: int,
        security: SocketSecurity,
        bucket_bytes: int = int(DEFAULT_BUCKET_MB * (1 << 20)),
        poll_ms: int = 10,
        reader_deadline_s: float = DEFAULT_READER_DEADLINE_S,
        max_readers: int = DEFAULT_MAX_READERS,
        max_snapshots: int = DEFAULT_MAX_SNAPSHOTS,
        hold_s: float = 0.0,
        relay: FanoutTree | None = None,
        chunk_bytes: int = 4 << 20,
        adapter: LoraConfig | None = None,
    ) -> None:
        if reader_deadline_s <= 0 or max_readers < 1 or max_snapshots < 2:
            raise ValueError(
                f"weights publisher limits: reader_deadline_s > 0 (got {reader_deadline_s}), max_readers >= 1 "
                f"(got {max_readers}), max_snapshots >= 2, the latest and the retired one (got {max_snapshots})"
            )
        self.bucket_bytes = bucket_bytes
        self.reader_deadline_s, self.max_readers, self.max_snapshots = reader_deadline_s, max_readers, max_snapshots
        self.hold_s = hold_s
        self.relay, self.chunk_bytes = relay, chunk_bytes  # relay None: the star (every reader gets everything)
        self.adapter = adapter  # adapter-only updates: the LoRA settings every header carries (None: full weights)
        self.counters: Counter[str] = Counter()
        self.bytes_by_version: dict[int, int] = {}  # bytes sent of each version (serving thread writes)
        self._held: dict[bytes, tuple[Request, float]] = {}  # routing id -> a request waiting for a newer version
        self._awaiting_digests: dict[bytes, tuple[Request, Snapshot, Any]] = {}  # relay headers, until digested
        self._latest: Snapshot | None = None
        self._retired: deque[Snapshot] = deque(maxlen=1)  # the previous snapshot: its buckets are reused
        self._readers: dict[bytes, _Reader] = {}  # routing id -> its reply in flight (serving thread only)
        self._waiting: dict[bytes, Request] = {}  # routing id -> its newest request, answered after that reply
        self._live_buckets: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()  # not freed
        self._lock = threading.RLock()
        self._served = threading.Condition(self._lock)  # notified when a snapshot becomes the latest
        self._published_version = -1  # the newest `publish` (served once sealed)
        self._sealer = ThreadPoolExecutor(1, thread_name_prefix="weights-seal") if relay is not None else None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._bind_error: BaseException | None = None
        self.rejected: Counter[str] = Counter()  # requests refused, by kind (the server's, across restarts)
        self._thread = supervised_thread(  # a fault outside one request: the loop restarts, its requests forgotten
            lambda: self._serve(host, port, security, poll_ms), "weights-publisher", self._stop, self._forget_requests
        )
        self._ready.wait()
        if self._bind_error is not None:
            raise self._bind_error

    @property
    def latest_version(self) -> int:
        with self._lock:
            return -1 if self._latest is None else self._latest.version

    def live_bucket_bytes(self) -> int:
        """Bytes of every snapshot bucket still allocated: referenced by the publisher or by a reply ZeroMQ has
        not let go of (what a reader that stops reading would make grow). Any thread."""
        return sum(bucket.nbytes for bucket in list(self._live_buckets.values()))

    def publish(self, version: int, layout: Layout, weights: Iterable[tuple[str, Any]]) -> float:
        """Copy `weights` into a new snapshot and make it the one served; returns the seconds it blocked.

        Relay: the chunks' digests are computed off the training loop, by the sealing thread, when a generator
        first needs them (see `_digest`); the loop waits for the copy only."""
        start = time.perf_counter()
        with self._lock:
            if version < self._published_version:
                raise ValueError(f"policy_version {version} is older than the published {self._published_version}")
            self._published_version = version
        snapshot = copy_into_snapshot(
            version, layout, weights, self.bucket_bytes, self._reusable_buckets(), adapter=self.adapter
        )
        self._live_buckets.update({id(bucket): bucket for bucket in snapshot.buckets})
        snapshot.chunk_bytes = self.chunk_bytes if self.relay is not None else 0
        self._make_latest(snapshot)
        self.counters["published"] += 1
        seconds = time.perf_counter() - start
        log.debug(
            "published v%d: %.1f MiB in %d buckets, %.3fs",
            version,
            sum(snapshot.header.bucket_sizes) / 2**20,
            len(snapshot.buckets),
            seconds,
        )
        return seconds

    def wait_for(self, version: int, timeout_s: float) -> bool:
        """Wait until `version` (or a newer one) is served; False after `timeout_s`. Any thread."""
        with self._served:
            return self._served.wait_for(lambda: self.latest_version >= version, timeout_s)

    def _digest(self, snapshot: Snapshot) -> None:
        """Sealing thread: every chunk's digest (256 MiB: 0.1-0.2 s of 2 cores), the first time a generator of this
        version is given a relay for parent (a fleet within k hosts never needs them)."""
        started = time.perf_counter()
        snapshot.digests = digest_chunks(snapshot.buckets, snapshot.chunk_bytes)  # one assignment: ready or not
        self.counters["digest_ms"] += int(1000 * (time.perf_counter() - started))

    def _make_latest(self, snapshot: Snapshot) -> None:
        with self._served:
            if self._latest is not None:
                self._retired.append(self._latest)
            self._latest = snapshot
            self._served.notify_all()

    def _reusable_buckets(self) -> list[np.ndarray] | None:
        """The retired snapshot's buckets if nothing can read them any more (see the module docstring)."""
        with self._lock:
            if not self._retired:
                return None
            retired = self._retired[0]
            if not buckets_reusable(retired):
                self.counters["fresh_buffers"] += 1
                return None
            self._retired.clear()
        self.counters["reused_buffers"] += 1
        return retired.buckets

    def _serve(self, host: str, port: int, security: SocketSecurity, poll_ms: int) -> None:
        try:
            server = Server(host, port, security, name="weights-publisher")
        except BaseException as error:  # reported to the constructor, which raises it
            if self._ready.is_set():  # a restart that cannot bind again: the supervisor retries, then exits
                raise
            self._bind_error = error
            self._ready.set()
            return
        server.rejected = self.rejected
        self._ready.set()
        try:
            while not self._stop.is_set():
                request = server.poll(timeout_ms=1 if self._waiting else poll_ms)  # waiting: its reply is near
                if request is not None:  # a fault while answering it: a rejected request (common.serving)
                    answer_safely(server, request, lambda request: self._answer(server, request))
                self._tend_readers(server, time.monotonic())
                self._tend_held(server, time.monotonic())
        finally:
            for kind, count in self.rejected.items():  # across restarts: the shared counter's totals
                self.counters[f"rejected/{kind}"] = count
            server.close()

    def _forget_requests(self, _: BaseException) -> None:
        """Before the serving loop restarts: the requests of the old socket cannot be answered on the new one."""
        self._held.clear()
        self._waiting.clear()
        self._readers.clear()

    def _answer(self, server: Server, request: Request) -> None:
        message = request.message
        if not isinstance(message, (WeightsRequest, ChunkRequest)):
            server.reject(
                request,
                f"the weights publisher answers weights_request and chunk_request only, not {type(message).WIRE_NAME}",
                "unexpected_type",
            )
            return
        if request.role not in WEIGHTS_READERS:
            reason = (
                f"a peer of role '{request.role or 'none'}' may not fetch weights (only {', '.join(WEIGHTS_READERS)}):"
                " connect with that role's key (tandem keys), or without keys declare the role (Client role=...)"
            )
            server.reject(request, reason, "forbidden_role")
            return
        if request.identity in self._readers:  # one reply in flight per connection: this one waits for it
            if self._waiting.pop(request.identity, None) is not None:
                self.counters["requests_superseded"] += 1
            self._waiting[request.identity] = request
            return
        self._dispatch(server, request)

    def _dispatch(self, server: Server, request: Request) -> None:
        if isinstance(request.message, ChunkRequest):
            self._send_chunks(server, request)
        else:
            self._send_latest(server, request)

    def _send_latest(self, server: Server, request: Request) -> None:
        message: WeightsRequest = request.message
        self._held.pop(request.identity, None)
        with self._lock:
            snapshot = self._latest
            newer = snapshot is not None and snapshot.version > message.have_version
            relayed = newer and self.relay is not None and bool(message.relay_address or message.host_id)
            busy = newer and not relayed and len(self._readers) >= self.max_readers
            if newer and not busy and not relayed:
                snapshot.readers += 1
        if not newer:
            if self.hold_s > 0:  # a long poll: answered at the next publish, or after hold_s
                self._held[request.identity] = (request, time.monotonic())
                return
            self.counters["not_newer"] += 1  # before the reply: whoever gets it sees it counted
            server.reply(request, WeightsNotNewer(latest_version=-1 if snapshot is None else snapshot.version))
            return
        if relayed:
            self._send_relay_header(server, request, snapshot)
            return
        if busy:
            reason = f"the weights publisher is sending to {self.max_readers} readers already: ask again shortly"
            server.reject(request, reason, "busy")
            return
        try:
            frames = [bucket.view() for bucket in snapshot.buckets]  # this reply's own references to the buckets
            self._readers[request.identity] = _Reader(snapshot, frames, time.monotonic(), request.peer_fd)
            server.reply(request, snapshot.header, payload=frames)  # ZeroMQ now holds the only references
        finally:
            with self._lock:
                snapshot.readers -= 1
        self.counters["served"] += 1
        self._count_bytes(snapshot.version, sum(b.nbytes for b in snapshot.buckets))

    def _count_bytes(self, version: int, nbytes: int) -> None:
        self.counters["served_bytes"] += nbytes
        self.bytes_by_version[version] = self.bytes_by_version.get(version, 0) + nbytes
        for old in sorted(self.bytes_by_version)[:-KEEP_BYTE_COUNTS]:
            del self.bytes_by_version[old]

    def _send_relay_header(self, server: Server, request: Request, snapshot: Snapshot) -> None:
        """Attach the generator to this version's tree and tell it its parent (no weight bytes go out here)."""
        message: WeightsRequest = request.message
        failed = message.failed_parent if message.failure and message.version == snapshot.version else None
        connection = tcp_connection(request.peer_fd)
        peer = str(connection[1][0]) if connection is not None else ""  # its IP: what a peer cannot multiply at will
        try:
            attached = self.relay.attach(
                snapshot.version, message.generator_id, message.relay_address, message.host_id, failed,
                message.failure, peer=peer,
            )  # fmt: skip
        except MembershipRefused as error:
            server.reject(request, str(error), "too_many_members")
            return
        if needs_digests(attached.parent) and not snapshot.digests:
            with self._lock:
                start, snapshot.digesting = not snapshot.digesting, True
            if start:
                self._sealer.submit(self._digest, snapshot)
            self._awaiting_digests[request.identity] = (request, snapshot, attached)  # answered by _tend_held
            return
        server.reply(request, snapshot.relay_header(attached.parent, attached.depth))
        self.counters["relay_headers"] += 1

    def _send_chunks(self, server: Server, request: Request) -> None:
        """Chunks of a version to a generator this publisher feeds directly (see `learners.fanout`)."""
        message: ChunkRequest = request.message
        with self._lock:
            snapshot = next(
                (s for s in (self._latest, *self._retired) if s is not None and s.version == message.version), None
            )
            served = snapshot is not None and snapshot.chunk_bytes > 0
            direct = served and self.relay.direct(message.version, message.generator_id)
            if direct:
                snapshot.readers += 1
        if not served:
            server.reply(request, ChunkUnavailable(message.version, "the publisher holds no copy of that version"))
            self.counters["chunks_unavailable"] += 1
            return
        if not direct:
            reason = f"generator {message.generator_id} was not told to pull v{message.version} from the publisher"
            server.reject(request, reason, "not_assigned")
            return
        try:
            ranges = chunk_ranges(snapshot.header.bucket_sizes, snapshot.chunk_bytes)
            frames, size = [], 0
            for bucket, start, end in ranges[message.first : message.first + message.max_chunks]:
                if frames and size + end - start > MAX_REPLY_BYTES:
                    break
                frames.append(snapshot.buckets[bucket][start:end])
                size += end - start
            if not frames:
                server.reject(request, f"chunk {message.first} is past the last ({len(ranges) - 1})", "bad_chunk")
                return
            self._readers[request.identity] = _Reader(snapshot, frames, time.monotonic(), request.peer_fd)
            server.reply(request, ChunkReply(message.version, message.first, len(frames)), payload=frames)
        finally:
            with self._lock:
                snapshot.readers -= 1
        self.counters["chunk_replies"] += 1
        self._count_bytes(snapshot.version, size)

    def _tend_held(self, server: Server, now: float) -> None:
        """Answer the long polls: with the new version once there is one, else `WeightsNotNewer` after hold_s; and
        the relay headers that waited for their version's digests."""
        for identity, (request, snapshot, attached) in list(self._awaiting_digests.items()):
            if snapshot.digests:
                del self._awaiting_digests[identity]
                server.reply(request, snapshot.relay_header(attached.parent, attached.depth))
                self.counters["relay_headers"] += 1
        latest = self.latest_version
        for identity, (request, since) in list(self._held.items()):
            if latest > request.message.have_version:
                self._send_latest(server, request)
            elif now - since > self.hold_s:
                del self._held[identity]
                self.counters["not_newer"] += 1
                server.reply(request, WeightsNotNewer(latest_version=latest))

    def _tend_readers(self, server: Server, now: float) -> None:
        """Retire finished replies (answering what waited for them), drop readers past the deadline, and drop the
        readers of the oldest snapshots while more than `max_snapshots` are alive. Serving thread only."""
        for identity, reader in list(self._readers.items()):
            if reader.done():
                del self._readers[identity]
                waiting = self._waiting.pop(identity, None)
                if waiting is not None:
                    self._dispatch(server, waiting)
            elif not reader.dropped and now - reader.sent_at > self.reader_deadline_s:
                self._drop(identity, reader, "slow")
        with self._lock:
            kept = {id(s) for s in (self._latest, *self._retired) if s is not None}
        held = sorted(
            {id(r.snapshot): r.snapshot for r in self._readers.values() if not r.dropped}.values(),
            key=lambda snapshot: snapshot.version,
        )
        older = [snapshot for snapshot in held if id(snapshot) not in kept]
        for snapshot in older[: max(0, len(older) - (self.max_snapshots - len(kept)))]:
            for identity, reader in list(self._readers.items()):
                if reader.snapshot is snapshot and not reader.dropped:
                    self._drop(identity, reader, "superseded")

    def _drop(self, identity: bytes, reader: _Reader, why: str) -> None:
        """Disconnect a reader: ZeroMQ then frees the reply it holds (the reader stays listed until it has)."""
        reader.dropped = why
        self._waiting.pop(identity, None)
        self.counters[f"dropped_readers/{why}"] += 1
        closed = disconnect_tcp(reader.connection)
        if not closed:
            self.counters["dropped_readers/not_disconnected"] += 1
        log.warning(
            "weights reader %s dropped (%s: v%d in flight for %.1fs; deadline %.1fs, %d snapshots at most)%s",
            identity.hex(),
            why,
            reader.snapshot.version,
            time.monotonic() - reader.sent_at,
            self.reader_deadline_s,
            self.max_snapshots,
            "" if closed else "; its connection could not be closed, its reply stays until the peer reads it",
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._sealer is not None:
            self._sealer.shutdown(wait=False, cancel_futures=True)


def open_weights_publisher(
    weights: WeightsConfig, host: str, port: int, security: SocketSecurity, lora: LoraConfig | None = None
) -> WeightsPublisher:
    """The publisher for `weights.transport` (common.config.WeightsConfig): 'relay' and 'star' are this module's
    ZeroMQ publisher (it long-polls: a request with nothing newer is answered at the next publish); raises
    ValueError for a transport this build cannot serve. `lora` (learner.lora): with rank > 0 and sync =
    "adapter" the updates are adapter-only and their headers carry its settings (relay and star only; the config
    refuses broadcast then)."""
    adapter = lora if lora is not None and lora.rank > 0 and lora.sync == "adapter" else None
    if adapter is not None and weights.transport not in ("relay", "star"):
        raise ValueError(
            f'learner.lora.sync = "adapter" needs weights.transport relay or star (got {weights.transport!r})'
        )
    if weights.transport in ("relay", "star"):
        relay = None
        if weights.transport == "relay":
            relay = FanoutTree(weights.fanout, weights.relay_fanout, weights.share_host_copy)
        chunk_bytes = max(ALIGN, int(weights.chunk_mb * (1 << 20)))
        return ZmqWeightsPublisher(
            host, port, security, hold_s=DEFAULT_HOLD_S, relay=relay, chunk_bytes=chunk_bytes, adapter=adapter
        )
    if weights.transport == "broadcast":
        from learners.broadcast_publisher import open_broadcast_publisher  # here: it builds on this module

        return open_broadcast_publisher(weights, host, port, security)
    raise ValueError(f"weights.transport must be 'relay', 'star' or 'broadcast' (got {weights.transport!r})")
