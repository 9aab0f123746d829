"""The relay transport, generator side: receive an update chunk by chunk from the parent the publisher names, check
every chunk against the publisher's digests, serve it on to children as it arrives, and share one copy per host.

    source = RelayWeightsSource(publisher_address, security, generator_id, config.weights, store_dir)
    update = source.fetch(have_version)   # a WeightsUpdate whose bytes lie in a host copy (update.staged), or the
    source.close()                        # latest version when nothing is newer (learners/fanout.py: the tree)

One fetch:
  1. `WeightsRequest(relay_address, host_id)` to the publisher. Its `WeightsHeader` (transport "relay") carries the
     layout, every chunk's sha256 and the parent: "" (the publisher), a generator's relay address, or
     "host:<id>" (another generator on this host receives it; this one maps its copy). A star reply (transport
     "zmq", the buckets as payload: a publisher without relay) is taken as it is.
  2. Receive: `ChunkRequest(version, first)` to the parent, which answers the chunks it holds from `first` (it holds
     the request until it has one, and answers `n_chunks = 0` after `stall_timeout_s / 2` to say it is alive). Each
     chunk is checked (length and digest) before it is written into the host copy; the relay server then serves
     it to this generator's own children.
  3. Re-attach: a parent that does not answer within `stall_timeout_s`, makes no progress for 3x that (alive but
     stuck), sends a chunk that fails its digest ("bad_chunk", counted) or has no copy ("unavailable") is reported
     to the publisher (`failed_parent`), which names another; receiving resumes at the first missing chunk. So a
     dead parent costs its children one timeout, and nothing unchecked is ever written.
  4. The update is complete when every chunk is; only then is it returned, so a generator never applies a partial
     or mixed-version update.

Host copies (`HostCopy`): one file per version in a store directory in shared memory that all generators of a host
share (`store_dir`): a 4 KiB header (magic, version, chunks done, chunk total, writer pid, abandoned) and the
buckets at `ALIGN`ed offsets. The writer advances "chunks done" after each checked chunk; readers map the file and
wait until every chunk is done, or re-ask the publisher when the writer died (its pid is gone), abandoned the copy,
or made no progress for 3 x stall_timeout_s. The engine's workers map the same file (`WeightsUpdate.staged`, opened
through /proc/<pid>/fd so a copy deleted meanwhile stays readable): socket -> host copy -> vLLM is the whole
chain. Each writer deletes its copies older than the previous version; `close()` (or the process's exit) deletes all
of its own; a new source deletes the copies of writers that died, and the launcher removes the store at the end.
At the first update the source checks that HOST_COPIES copies fit in the store's file system (counting the copies
already there): a /dev/shm too small for them (a container's 64 MiB) moves the store to the temporary directory,
said once (`common.weights.room_for`); every generator of the host decides alike, so they keep sharing one store.
No room anywhere, or not for one more copy, is a WeightsTransportError, never SIGBUS.
"""

from __future__ import annotations

import atexit
import logging
import re
import socket
import threading
import time
import typing
import weakref
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from actors.weights.host_copy import (
    HOST_COPIES,
    HostCopy,
    copy_bytes,
    delete_copies,
    delete_orphaned_copies,
    held_bytes,
    private_store_dir,
)
from actors.weights.updates import LayoutGuard, WeightsTransportError, WeightsUpdate, ask_publisher
from common.config import WeightsConfig
from common.connections import TcpConnection, disconnect_tcp, tcp_connection
from common.serving import answer_safely, supervised_thread
from common.sockets import Client, PeerUnavailable, Request, SecurityError, Server, SocketSecurity
from common.types import ErrorReply
from common.weight_messages import ChunkReply, ChunkRequest, ChunkUnavailable, WeightsHeader, WeightsRequest
from common.weights import (
    ALIGN,
    WeightsLayoutError,
    check_frames,
    check_layout,
    chunk_digest,
    digest_chunks,
    room_for,
)
from common.wire import WireError

log = logging.getLogger("tandem.actors.relay")

HOST_PREFIX = "host:"
RELAY_CLIENTS = ("generator", "eval")  # roles a relay serves chunks to
PIPELINE_CHUNKS = 2  # chunks asked for at once (a parent answers what it holds, up to its byte cap): each hop
# lags its parent by about this many chunks, so a chain of depth d adds ~d x 2 chunks to an update
# One reply must arrive within stall_timeout_s (ZeroMQ delivers a message whole): 16 MiB take 0.13 s at 1 Gbit/s,
# 0.84 s at 160 Mbit/s, so even an uplink shared by a few children stays well inside the default 5 s.
MAX_REPLY_BYTES = 16 << 20
STUCK_FACTOR = 3  # no progress for this many stall timeouts: an alive but stuck parent is dropped too
SERVER_POLL_MS = 2  # how often the relay server looks whether a held request can be answered
IDLE_POLL_MS = 200  # its wait for a request when it holds none (a request wakes it at once)
HOST_COPY_POLL_S = 0.005  # how often a host-copy reader looks at the writer's progress
# What a header from the publisher may announce (checked before anything is allocated for it):
MAX_CHUNKS = 1 << 18  # chunks of one update (1 TiB at the default 4 MiB; the chunk table costs ~30 MB at most)
MAX_CHUNK_BYTES = MAX_REPLY_BYTES  # a chunk must fit in one reply
PARENT_ADDRESS = re.compile(r"^(host:\d{1,18}|\[?[A-Za-z0-9.:_-]{1,253}\]?:\d{1,5})$")  # host:<id> or host:port
# A relay's replies in flight (sent, not yet taken by the child's ZeroMQ): each pins up to MAX_REPLY_BYTES here.
MAX_REPLIES_IN_FLIGHT = 8  # at once, over all children (one per child connection: its next request waits)


class RelayError(RuntimeError):
    """The publisher's reply cannot be used for a relay receive (a malformed header)."""


def default_host_id() -> str:
    """This machine: its hostname and boot id (generators on one machine share /dev/shm)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}-{boot}"


# ------------------------------------------------------------------------------------------------ relay server
@dataclass
class _Sent:
    """A reply of chunks that ZeroMQ has not finished sending: its frames (weakly: ZeroMQ holds them until sent)."""

    frames: list[weakref.ref]
    sent_at: float
    connection: TcpConnection | None
    dropped: bool = False

    def done(self) -> bool:
        return all(frame() is None for frame in self.frames)


class RelayServer:
    """Serves this generator's copies to its children from a daemon thread (`ChunkRequest` -> `ChunkReply`).

    A child (another generator, possibly a lying one) that never reads costs bounded memory: each reply's chunks
    are copied out of the host copy and stay here until ZeroMQ has sent them, so one reply is in flight per
    connection (its next request waits for it; an older waiting one is dropped: `requests_superseded`), at most
    `max_in_flight` over all children (a reply beyond waits like a held request, then answers "nothing yet"), and
    a reply still unsent after `reply_deadline_s` has its connection shut (`dropped_children`): at most
    max_in_flight x MAX_REPLY_BYTES (128 MiB) whatever the children do."""

    def __init__(
        self,
        host: str,
        security: SocketSecurity,
        hold_s: float,
        name: str,
        toward: str = "",
        max_in_flight: int = MAX_REPLIES_IN_FLIGHT,
    ) -> None:
        self.server = Server(host, 0, security, name=name)
        endpoint = self.server.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.address = f"{advertised_host(host, toward)}:{endpoint.rsplit(':', 1)[1]}"
        self.hold_s = hold_s
        self.max_in_flight = max_in_flight
        self.reply_deadline_s = 4 * hold_s  # 2 x the child's stall timeout: an honest child gave up long before
        self._sent: dict[bytes, _Sent] = {}  # routing id -> its reply in flight (serving thread only)
        self._waiting: dict[bytes, Request] = {}  # routing id -> its next request, answered once that reply is sent
        self.copies: dict[int, HostCopy] = {}  # version -> the copy this generator writes or wrote (last two)
        self._lock = threading.Lock()  # copies: the fetch thread offers and retires, the serving thread reads
        self.counters: Counter[str] = Counter()
        self._held: dict[bytes, tuple[Request, float]] = {}
        self._stop = threading.Event()
        self._thread = supervised_thread(self._serve, "weights-relay", self._stop, lambda _: self._held.clear())

    def offer(self, copy: HostCopy) -> None:
        """Serve `copy` (chunks as they are written); keeps it and the previous version only."""
        with self._lock:
            self.copies[copy.header.policy_version] = copy
            for version in sorted(self.copies)[:-2]:
                self.copies.pop(version, None)

    def retire_below(self, version: int) -> None:
        """Stop serving copies older than `version` (a child still pulling one is told 'unavailable')."""
        with self._lock:
            for old in [v for v in self.copies if v < version]:
                del self.copies[old]

    @property
    def rejected(self) -> dict[str, int]:
        """Requests refused so far, by kind (`common.sockets.Server.rejected`): for the generator's metrics."""
        return dict(self.server.rejected)

    def _serve(self) -> None:
        """A fault while answering one request rejects it (`common.serving`); one elsewhere restarts this loop."""
        while not self._stop.is_set():
            request = self.server.poll(timeout_ms=SERVER_POLL_MS if self._held else IDLE_POLL_MS)
            if request is not None:
                answer_safely(self.server, request, self._answer)
            for identity, (held, since) in list(self._held.items()):
                if not answer_safely(self.server, held, lambda r, i=identity, s=since: self._retry(i, r, s)):
                    self._held.pop(identity, None)
            self._tend_sent(time.monotonic())

    def _retry(self, identity: bytes, held: Request, since: float) -> None:
        if self._try_send(held, since):
            del self._held[identity]

    def _answer(self, request: Request) -> None:
        if not isinstance(request.message, ChunkRequest):
            self.server.reject(request, "a relay answers chunk_request only", "unexpected_type")
        elif request.role not in RELAY_CLIENTS:
            self.server.reject(request, f"role '{request.role or 'none'}' may not fetch weights", "forbidden_role")
        elif request.identity in self._sent:  # its previous reply is still in flight: this one waits for it
            if self._waiting.pop(request.identity, None) is not None:
                self.counters["requests_superseded"] += 1
            self._waiting[request.identity] = request
        elif not self._try_send(request, time.monotonic()):
            self._held[request.identity] = (request, time.monotonic())

    def _tend_sent(self, now: float) -> None:
        """Forget the replies ZeroMQ has sent (answering what waited for them); shut the connection of a child whose
        reply is unsent past the deadline (ZeroMQ then frees it)."""
        for identity, sent in list(self._sent.items()):
            if sent.done():
                del self._sent[identity]
                waiting = self._waiting.pop(identity, None)
                if waiting is not None:
                    answer_safely(self.server, waiting, self._answer)
            elif not sent.dropped and now - sent.sent_at > self.reply_deadline_s:
                sent.dropped = True
                self._waiting.pop(identity, None)
                self._held.pop(identity, None)
                self.counters["dropped_children"] += 1
                if not disconnect_tcp(sent.connection):
                    self.counters["dropped_children/not_disconnected"] += 1
                log.warning("weights relay: child %s took no reply in %.1fs: disconnected", identity.hex(),
                            now - sent.sent_at)  # fmt: skip

    def in_flight_bytes(self) -> int:
        """Bytes of chunk replies ZeroMQ still holds: what children that do not read pin here."""
        frames = [frame() for sent in list(self._sent.values()) for frame in sent.frames]
        return sum(frame.nbytes for frame in frames if frame is not None)

    def _try_send(self, request: Request, since: float) -> bool:
        """Answer if possible (chunks, unavailable, or alive-but-waiting after hold_s); False: keep holding."""
        message: ChunkRequest = request.message
        with self._lock:
            copy = self.copies.get(message.version)
            newest = max(self.copies, default=-1)
        if copy is None and message.version > newest:
            # Told to receive it, not started yet (a child may ask before its parent has its own header): wait.
            if time.monotonic() - since < self.hold_s:
                return False
            self.server.reply(request, ChunkReply(message.version, message.first, 0))
            return True
        if copy is None or copy.fields()[5]:
            self.server.reply(request, ChunkUnavailable(message.version, "this relay holds no copy of that version"))
            self.counters["unavailable"] += 1
            return True
        if message.first >= copy.total:
            self.server.reject(request, f"chunk {message.first} is past the last ({copy.total - 1})", "bad_chunk")
            return True
        done = copy.done
        if done <= message.first or len(self._sent) >= self.max_in_flight:
            if time.monotonic() - since < self.hold_s:
                return False
            self.server.reply(request, ChunkReply(message.version, message.first, 0))
            if done > message.first:
                self.counters["busy"] += 1
            return True
        frames, size = [], 0
        for index in range(message.first, min(done, message.first + message.max_chunks)):
            view = copy.chunk_view(index)
            if frames and size + view.nbytes > MAX_REPLY_BYTES:
                break
            frames.append(np.frombuffer(view, np.uint8).copy())  # a copy: the file may be reused once retired
            size += view.nbytes
        sent = _Sent([weakref.ref(frame) for frame in frames], time.monotonic(), tcp_connection(request.peer_fd))
        self._sent[request.identity] = sent
        self.server.reply(request, ChunkReply(message.version, message.first, len(frames)), payload=frames)
        self.counters["served_bytes"] += size
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.server.close()


class NoRelay:
    """A generator that cannot serve chunks (its relay could not bind or has no server key): a leaf of the tree."""

    address = ""
    rejected: typing.ClassVar[dict[str, int]] = {}  # serves nobody, refuses nothing

    def offer(self, copy: HostCopy) -> None:
        del copy  # nobody pulls from a leaf

    def retire_below(self, version: int) -> None:
        del version

    def close(self) -> None:
        pass


def advertised_host(host: str, toward: str) -> str:
    """The address other generators reach a relay bound on `host` at: `host` itself, or for a wildcard bind
    (0.0.0.0, *, ::) this machine's address on the route toward `toward` (the publisher's host:port)."""
    if host not in ("0.0.0.0", "*", "::", ""):
        return host
    target, _, port = toward.rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # a UDP connect sends nothing: it routes
            probe.connect((target.strip("[]") or "127.0.0.1", int(port or 9)))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def open_relay_server(
    host: str, security: SocketSecurity, hold_s: float, generator_id: int, toward: str = ""
) -> RelayServer | NoRelay:
    """This generator's relay server, or `NoRelay` (logged) when it cannot run: the generator still receives.
    `toward`: the publisher's address (what a wildcard `host` is advertised for)."""
    try:
        return RelayServer(host, security, hold_s, f"relay-{generator_id}", toward)
    except (OSError, SecurityError) as error:
        log.warning("weights relay off for this generator (it will only receive): %s", error)
        return NoRelay()


# -------------------------------------------------------------------------------------------------- the source
MAX_PARENT_CLIENTS = 4  # connections kept to parents (a new parent after each failure)


def check_relay_header(header: WeightsHeader) -> None:
    """A relay header's own fields (see `RelayWeightsSource._check_header`); raises `WeightsLayoutError`."""
    if not 0 < header.chunk_bytes <= MAX_CHUNK_BYTES:
        raise WeightsLayoutError(f"chunk_bytes {header.chunk_bytes} is outside 1 .. {MAX_CHUNK_BYTES}")
    check_packed(header)
    chunks = sum(-(-size // header.chunk_bytes) for size in header.bucket_sizes)  # before chunk_ranges builds them
    if chunks > MAX_CHUNKS:
        raise WeightsLayoutError(
            f"{chunks} chunks of {header.chunk_bytes} bytes: over {MAX_CHUNKS} (the publisher's weights.chunk_mb is "
            "too small for this model: raise it)"
        )
    if header.parent and not PARENT_ADDRESS.fullmatch(header.parent):
        raise WeightsLayoutError(f"parent {header.parent[:80]!r} is neither host:<generator id> nor host:port")
    if header.parent and len(header.chunk_digests) != chunks:
        raise WeightsLayoutError(f"{len(header.chunk_digests)} digests for {chunks} chunks")
    if not header.parent and header.chunk_digests:
        raise WeightsLayoutError("digests in a header for chunks from the publisher itself")


def check_packed(header: WeightsHeader) -> None:
    """Each bucket holds its tensors packed from byte 0 in offset order, each at the next `ALIGN`ed byte, and ends
    with its last tensor (`common.weights.plan_buckets`): so an update's bytes are its tensors' (plus < ALIGN a
    tensor), whatever sizes a header claims. Raises `WeightsLayoutError`."""
    ends = [0] * len(header.bucket_sizes)
    for spec in sorted(header.tensors, key=lambda t: (t.bucket, t.offset)):
        if spec.offset != ends[spec.bucket] + (-ends[spec.bucket]) % ALIGN:
            raise WeightsLayoutError(f"tensor {spec.name[:80]!r}: offset {spec.offset} leaves a gap in its bucket")
        ends[spec.bucket] = spec.offset + spec.nbytes
    if ends != list(header.bucket_sizes):
        raise WeightsLayoutError(f"bucket sizes {header.bucket_sizes[:8]} are not the ends of their tensors")


class RelayWeightsSource:
    """`WeightsSource` of the relay transport (see the module docstring). `fetch` runs in one thread at a time."""

    def __init__(
        self,
        address: str,
        security: SocketSecurity,
        generator_id: int,
        weights: WeightsConfig,
        store_dir: Path,
        timeout_s: float = 120.0,
    ) -> None:
        self.address, self.security, self.generator_id = address, security, generator_id
        self.stall_timeout_s, self.timeout_s = weights.stall_timeout_s, timeout_s
        host = weights.host_id or default_host_id()
        self.host_id = host if weights.share_host_copy else f"{host}/generator-{generator_id}"
        self.store_dir = private_store_dir(store_dir)  # StoreDirError: another user's, or others may write it
        delete_orphaned_copies(store_dir)
        atexit.register(delete_copies, store_dir, generator_id)  # also when close() is never reached
        self.publisher = Client(address, security, identity=f"generator-{generator_id}-weights", role="generator")
        hold_s = weights.stall_timeout_s / 2
        self.relay = open_relay_server(weights.relay_host, security, hold_s, generator_id, toward=address)
        self.layout = LayoutGuard()
        self.store_placed = False  # _place_store decided, at the first update
        self.counters: Counter[str] = Counter()  # reattached/<failure>, bad_chunks, received_bytes, ...
        self.last_receive: dict[str, Any] = {}  # version, depth, parent, seconds, reattachments
        self._parents: dict[str, Client] = {}

    def fetch(self, have_version: int) -> WeightsUpdate | int:
        started = time.monotonic()
        reply = self._ask(WeightsRequest(self.generator_id, have_version, self.relay.address, self.host_id))
        if isinstance(reply, int):
            return reply
        header, payload = reply
        if header.transport == "zmq":  # a star publisher: the whole update came with the header
            try:
                return WeightsUpdate(header, check_frames(header, payload), received_at=time.monotonic())
            except WeightsLayoutError as error:
                raise WeightsTransportError(f"malformed weights update: {error}") from None
        copy, header = self._receive(header)
        self.last_receive = {
            "version": header.policy_version,
            "depth": header.depth,
            "parent": header.parent,
            "seconds": time.monotonic() - started,
        }
        return WeightsUpdate(header, copy.buckets(), time.monotonic(), staged=copy.staged(), keep=copy)

    # ------------------------------------------------------------------------------------------------ asking
    def _ask(self, request: WeightsRequest) -> int | tuple[WeightsHeader, list[memoryview]]:
        reply = ask_publisher(self.publisher, request, self.timeout_s, ("relay", "zmq"), "the weight publisher")
        if not isinstance(reply, int):
            self._check_header(reply[0])
        return reply

    def _check_header(self, header: WeightsHeader) -> None:
        """Every field a relay receive allocates or indexes by, bounded before anything is allocated (the header
        may come from a fake publisher): the layout (`check_layout`), buckets packed as the publisher lays them out
        (so their bytes are the tensors' plus alignment, pinned by `LayoutGuard` after the first update), a chunk
        size and count in bounds, a parent address of a known form, a digest per chunk unless the publisher itself
        sends them. Raises `WeightsTransportError` (counted by the poller, asked again)."""
        try:
            check_layout(header)
            if header.transport == "relay":
                check_relay_header(header)
        except (WeightsLayoutError, ValueError) as error:
            raise WeightsTransportError(f"malformed weights header: {error}") from None
        self.layout.check(header)

    def _reattach(self, header: WeightsHeader, failure: str) -> WeightsHeader:
        """Report the parent failed and get another (or a newer version, if the publisher moved on)."""
        self.counters[f"reattached/{failure}"] += 1
        parent = header.parent or "the publisher"
        log.warning(
            "weights v%d: parent %s %s; asking the publisher for another", header.policy_version, parent, failure
        )
        request = WeightsRequest(
            self.generator_id,
            header.policy_version - 1,
            self.relay.address,
            self.host_id,
            failed_parent=header.parent,
            failure=failure,
            version=header.policy_version,
        )
        reply = self._ask(request)
        if isinstance(reply, int) or reply[0].transport != "relay":
            raise WeightsTransportError(f"the publisher no longer offers v{header.policy_version} by relay")
        new = reply[0]
        same = (new.bucket_sizes, new.chunk_bytes) == (header.bucket_sizes, header.chunk_bytes)
        if new.policy_version == header.policy_version and not same:  # the copy in hand is laid out by the old one
            raise WeightsTransportError(
                f"the publisher changed v{header.policy_version}'s buckets or chunks mid-update"
            )
        return new

    # --------------------------------------------------------------------------------------------- receiving
    def _place_store(self, header: WeightsHeader) -> None:
        """Once, at the first update (the layout stays: LayoutGuard): keep the store where HOST_COPIES copies of
        it fit, counting the copies already in it (room_for: else the temporary directory's store of the same
        name). The generators of a host see the same free space and the same copies, so they decide alike.
        WeightsTransportError (asked again later) when they fit nowhere."""
        if self.store_placed:
            return
        try:
            directory = room_for(self.store_dir, HOST_COPIES * copy_bytes(header), held_bytes(self.store_dir))
        except OSError as error:
            raise WeightsTransportError(f"no room for the host copies of the weights: {error}") from None
        if directory != self.store_dir:
            delete_copies(self.store_dir, self.generator_id)
            self.store_dir = private_store_dir(directory)
            delete_orphaned_copies(self.store_dir)
            atexit.register(delete_copies, self.store_dir, self.generator_id)
        self.store_placed = True

    def _receive(self, header: WeightsHeader) -> tuple[HostCopy, WeightsHeader]:
        """Until one copy of `header`'s version is complete: written here, or another host generator's."""
        self._place_store(header)
        reattachments = 0
        own: HostCopy | None = None
        while True:
            if header.parent.startswith(HOST_PREFIX):
                found, failure = self._wait_host_copy(header)
                copy = found if found is not None else own
            else:
                if own is None or own.header.policy_version != header.policy_version:
                    if own is not None:
                        own.abandon()
                    self.relay.retire_below(header.policy_version - 1)
                    try:
                        own = HostCopy.create(self.store_dir, header, self.generator_id)
                    except (OSError, ValueError) as error:  # no room for it (a size the header may lie about)
                        raise WeightsTransportError(f"no host copy for v{header.policy_version}: {error}") from None
                    self.relay.offer(own)
                copy, failure = own, self._pull(own, header)
            if failure is None:
                break
            header = self._reattach(header, failure)
            reattachments += 1
        assert copy is not None  # a loop that ends without failure has a copy
        if copy.writer:
            delete_copies(self.store_dir, self.generator_id, below_version=header.policy_version - 1)
        self.counters["received"] += 1
        self.counters["reattachments"] += reattachments
        return copy, header

    def _pull(self, copy: HostCopy, header: WeightsHeader) -> str | None:
        """Pull every missing chunk from the parent; None when complete, else why the parent failed."""
        address = header.parent or self.address
        client = self._parents.get(address)
        if client is None:
            try:
                client = Client(address, self.security, f"generator-{self.generator_id}-chunks", role="generator")
            except (ValueError, zmq.ZMQError) as error:  # an address ZeroMQ cannot dial
                log.warning("weights: parent %r cannot be dialled: %s", address[:80], error)
                return "unavailable"
            for old in list(self._parents)[: -MAX_PARENT_CLIENTS + 1]:  # a parent per failure: keep the last few
                self._parents.pop(old).close()
            self._parents[address] = client
        # Chunks from the publisher itself come from the one party whose digests are trusted, over the connection
        # its header came on (CURVE-authenticated off loopback): only a relay's chunks are hashed (~0.2 s / 256 MB).
        relayed = header.parent != ""
        progress_at = time.monotonic()
        while not copy.complete():
            first = copy.done
            request = ChunkRequest(self.generator_id, header.policy_version, first, PIPELINE_CHUNKS)
            try:
                reply, frames = client.request(request, timeout_s=self.stall_timeout_s)
            except PeerUnavailable:
                return "stalled"
            except WireError:
                client.reset()
                return self._bad("a malformed reply")
            if isinstance(reply, (ChunkUnavailable, ErrorReply)):
                return "unavailable"
            if not isinstance(reply, ChunkReply) or reply.version != header.policy_version or reply.first != first:
                return self._bad("a reply for other chunks")
            if len(frames) != reply.n_chunks or first + reply.n_chunks > copy.total:
                return self._bad("a reply whose frames disagree with it")
            if reply.n_chunks == 0:  # alive, waiting itself
                if time.monotonic() - progress_at > STUCK_FACTOR * self.stall_timeout_s:
                    return "stalled"
                continue
            for index, frame in enumerate(frames, start=first):
                _, start, end = copy.ranges[index]
                if frame.nbytes != end - start or (relayed and chunk_digest(frame) != header.chunk_digests[index]):
                    return self._bad(f"chunk {index} that fails its digest")
                copy.write_chunk(index, frame)
                self.counters["received_bytes"] += frame.nbytes
            progress_at = time.monotonic()
        return None

    def _bad(self, what: str) -> str:
        self.counters["bad_chunks"] += 1
        log.warning("weights: the parent sent %s: dropping it", what)
        return "bad_chunk"

    def _wait_host_copy(self, header: WeightsHeader) -> tuple[HostCopy | None, str | None]:
        """Wait until the host's receiver completes its copy; a failure when it died, gave up or is stuck."""
        writer = int(header.parent.removeprefix(HOST_PREFIX))
        deadline = time.monotonic() + self.stall_timeout_s
        copy = None
        while copy is None:
            copy = HostCopy.open(self.store_dir, header, writer)
            if copy is None and time.monotonic() > deadline:
                return None, "stalled"
            time.sleep(HOST_COPY_POLL_S)
        done, progress_at = -1, time.monotonic()
        while not copy.complete():
            if copy.writer_gone():
                return copy, "unavailable"
            if copy.done != done:
                done, progress_at = copy.done, time.monotonic()
            elif time.monotonic() - progress_at > STUCK_FACTOR * self.stall_timeout_s:
                return copy, "stalled"
            time.sleep(HOST_COPY_POLL_S)
        if digest_chunks(copy.buckets(), header.chunk_bytes) != header.chunk_digests:  # before anything maps it
            self.counters["bad_host_copies"] += 1
            log.warning("weights v%d: generator %d's host copy fails the publisher's digests: refused",
                        header.policy_version, writer)  # fmt: skip
            return None, "bad_chunk"
        self.counters["host_copies_mapped"] += 1
        return copy, None

    def close(self) -> None:
        self.relay.close()
        self.publisher.close()
        for client in self._parents.values():
            client.close()
        delete_copies(self.store_dir, self.generator_id)
