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
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import mmap
import os
import re
import socket
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import zmq

from actors.weights import LayoutGuard, WeightsTransportError, WeightsUpdate, ask_publisher
from common.config import WeightsConfig
from common.processes import pid_alive
from common.sockets import Client, PeerUnavailable, Request, SecurityError, Server, SocketSecurity
from common.types import (
    ChunkReply,
    ChunkRequest,
    ChunkUnavailable,
    ErrorReply,
    WeightsHeader,
    WeightsRequest,
)
from common.weights import ALIGN, WeightsLayoutError, check_frames, check_layout, chunk_digest, chunk_ranges
from common.wire import WireError

log = logging.getLogger("tandem.actors.relay")

HOST_PREFIX = "host:"
RELAY_CLIENTS = ("generator", "eval")  # roles a relay serves chunks to
HEADER_BYTES = 4096
MAGIC = b"TNDMWGT1"
_FIELDS = struct.Struct("<8sqqqqq")  # magic, version, chunks done, chunk total, writer pid, abandoned
PIPELINE_CHUNKS = 2  # chunks asked for at once (a parent answers what it holds, up to its byte cap): each hop
# lags its parent by about this many chunks, so a chain of depth d adds ~d x 2 chunks to an update
# One reply must arrive within stall_timeout_s (ZeroMQ delivers a message whole): 16 MiB take 0.13 s at 1 Gbit/s,
# 0.84 s at 160 Mbit/s, so even an uplink shared by a few children stays well inside the default 5 s.
MAX_REPLY_BYTES = 16 << 20
STUCK_FACTOR = 3  # no progress for this many stall timeouts: an alive but stuck parent is dropped too
SERVER_POLL_MS = 2  # how often the relay server looks whether a held request can be answered
IDLE_POLL_MS = 200  # its wait for a request when it holds none (a request wakes it at once)
HOST_COPY_POLL_S = 0.005  # how often a host-copy reader looks at the writer's progress
COPY_NAME = re.compile(r"^v(\d+)-g(\d+)\.bin$")


class RelayError(RuntimeError):
    """The publisher's reply cannot be used for a relay receive (a malformed header)."""


def default_host_id() -> str:
    """This machine: its hostname and boot id (generators on one machine share /dev/shm)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}-{boot}"


# -------------------------------------------------------------------------------------------------- host copy
class HostCopy:
    """One version's bytes in a shared-memory file (see the module docstring). The writer is one thread; readers
    (the relay server thread, other generators, vLLM workers) only read bytes below "chunks done"."""

    def __init__(self, path: Path, header: WeightsHeader, fd: int, mapped: mmap.mmap, writer: bool) -> None:
        self.path, self.header, self.fd, self.mapped, self.writer = path, header, fd, mapped, writer
        fcntl.flock(fd, fcntl.LOCK_SH)  # "in use" while this object lives: a writer reuses only unlocked files
        self.ranges = chunk_ranges(header.bucket_sizes, header.chunk_bytes)
        self.starts = _bucket_starts(header.bucket_sizes)

    @classmethod
    def create(cls, directory: Path, header: WeightsHeader, generator_id: int) -> HostCopy:
        """A copy to write `header`'s version into: one of this generator's older files that nothing uses any
        more (no HostCopy anywhere holds its lock: no reader maps it for a load to come) when there is one, so its
        pages are warm (a write into fresh shared-memory pages costs ~7x: page faults), else a new file."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"v{header.policy_version}-g{generator_id}.bin"
        path.unlink(missing_ok=True)  # a copy this generator left before a restart
        starts = _bucket_starts(header.bucket_sizes)
        size = (starts[-1] + header.bucket_sizes[-1]) if header.bucket_sizes else HEADER_BYTES
        fd = _reusable(directory, generator_id, below_version=header.policy_version - 1)
        if fd is not None:
            os.rename(_fd_path(fd), path)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, size)
        # MAP_POPULATE: the page tables are filled at once (a reused file's pages exist: ~65k minor faults per 256 MiB
        # saved), not one fault per 4 KiB page during the copy.
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        copy = cls(path, header, fd, mapped, writer=True)  # takes LOCK_SH (from LOCK_EX if reused)
        copy._write_fields(done=0, abandoned=0)
        return copy

    @classmethod
    def open(cls, directory: Path, header: WeightsHeader, generator_id: int) -> HostCopy | None:
        """Another generator's copy of this version (None while it does not exist yet)."""
        path = directory / f"v{header.policy_version}-g{generator_id}.bin"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        except ValueError:  # the writer has not sized it yet
            os.close(fd)
            return None
        return cls(path, header, fd, mapped, writer=False)

    def fields(self) -> tuple[bytes, int, int, int, int, int]:
        return _FIELDS.unpack_from(self.mapped, 0)

    @property
    def done(self) -> int:
        """Chunks written and checked; 0 while the file still holds another version (a reused file whose writer
        has not re-initialised its header yet)."""
        magic, version, done, _, _, _ = self.fields()
        return done if magic == MAGIC and version == self.header.policy_version else 0

    @property
    def total(self) -> int:
        return len(self.ranges)

    def complete(self) -> bool:
        return self.done >= self.total

    def write_chunk(self, index: int, data: Any) -> None:
        """Write chunk `index` (already checked) and publish it to readers. Chunks come in order."""
        bucket, start, end = self.ranges[index]
        offset = self.starts[bucket] + start
        self.mapped[offset : offset + end - start] = data
        self._write_fields(done=index + 1, abandoned=0)

    def chunk_view(self, index: int) -> memoryview:
        bucket, start, end = self.ranges[index]
        offset = self.starts[bucket] + start
        return memoryview(self.mapped)[offset : offset + end - start]

    def abandon(self) -> None:
        if self.writer:
            self._write_fields(done=self.done, abandoned=1)

    def writer_gone(self) -> bool:
        """The writer abandoned the copy or its process no longer exists."""
        magic, version, _, _, pid, abandoned = self.fields()
        if magic != MAGIC or version != self.header.policy_version:
            return False  # not initialised yet
        return bool(abandoned) or not pid_alive(pid)

    def buckets(self) -> list[memoryview]:
        view = memoryview(self.mapped)
        return [view[start : start + size] for start, size in zip(self.starts, self.header.bucket_sizes)]

    def staged(self) -> tuple[Path, list[tuple[str, str, list[int], int, int]]]:
        """(a path the engine's workers can open even after the copy is deleted, each tensor's place in it)."""
        tensors = [
            (s.name, s.dtype, list(s.shape), self.starts[s.bucket] + s.offset, s.nbytes) for s in self.header.tensors
        ]
        return Path(f"/proc/{os.getpid()}/fd/{self.fd}"), tensors

    def _write_fields(self, done: int, abandoned: int) -> None:
        # One 48-byte store after the chunk's bytes: a reader that sees `done` sees the bytes (x86-64 keeps
        # stores in order, and readers never go past `done`).
        values = (MAGIC, self.header.policy_version, done, self.total, os.getpid(), abandoned)
        _FIELDS.pack_into(self.mapped, 0, *values)

    def __del__(self) -> None:  # the fd backs `staged()`: it lives as long as the copy (views keep the map alive)
        fd, self.fd = getattr(self, "fd", -1), -1
        if fd >= 0:
            os.close(fd)


def _reusable(directory: Path, generator_id: int, below_version: int) -> int | None:
    """A descriptor, locked exclusively, of this generator's newest copy older than `below_version` that no
    HostCopy holds (nobody will read it again); None when there is none."""
    own = []
    for path in directory.iterdir():
        match = COPY_NAME.match(path.name)
        if match and int(match.group(2)) == generator_id and int(match.group(1)) < below_version:
            own.append((int(match.group(1)), path))
    for _, path in sorted(own, reverse=True):
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            os.close(fd)
    return None


def _fd_path(fd: int) -> str:
    """The path of an open descriptor's file (its name in its directory)."""
    return os.readlink(f"/proc/self/fd/{fd}")


def _bucket_starts(sizes: list[int]) -> list[int]:
    starts, position = [], HEADER_BYTES
    for size in sizes:
        position += (-position) % ALIGN
        starts.append(position)
        position += size
    return starts


def delete_orphaned_copies(directory: Path) -> None:
    """Delete the copies whose writer process is gone (a generator killed hard leaves its copies behind)."""
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if not COPY_NAME.match(path.name):
            continue
        try:
            with open(path, "rb") as file:
                magic, _, _, _, pid, _ = _FIELDS.unpack(file.read(_FIELDS.size))
        except (OSError, struct.error):
            continue
        if magic == MAGIC and not pid_alive(pid):
            path.unlink(missing_ok=True)


def delete_copies(directory: Path, generator_id: int, below_version: int | None = None) -> None:
    """Delete this generator's copies (those of versions < below_version, or all). Readers that mapped one keep it."""
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        match = COPY_NAME.match(path.name)
        mine = match is not None and int(match.group(2)) == generator_id
        if mine and (below_version is None or int(match.group(1)) < below_version):
            path.unlink(missing_ok=True)
    if below_version is None:
        try:
            directory.rmdir()
        except OSError:
            pass  # another generator's copies are still there


# ------------------------------------------------------------------------------------------------ relay server
class RelayServer:
    """Serves this generator's copies to its children from a daemon thread (`ChunkRequest` -> `ChunkReply`)."""

    def __init__(self, host: str, security: SocketSecurity, hold_s: float, name: str, toward: str = "") -> None:
        self.server = Server(host, 0, security, name=name)
        endpoint = self.server.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.address = f"{advertised_host(host, toward)}:{endpoint.rsplit(':', 1)[1]}"
        self.hold_s = hold_s
        self.copies: dict[int, HostCopy] = {}  # version -> the copy this generator writes or wrote (last two)
        self._lock = threading.Lock()  # copies: the fetch thread offers and retires, the serving thread reads
        self.counters: Counter[str] = Counter()
        self._held: dict[bytes, tuple[Request, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="weights-relay", daemon=True)
        self._thread.start()

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

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                request = self.server.poll(timeout_ms=SERVER_POLL_MS if self._held else IDLE_POLL_MS)
                if request is not None:
                    self._answer(request)
                for identity, (held, since) in list(self._held.items()):
                    if self._try_send(held, since):
                        del self._held[identity]
        finally:
            self.server.close()

    def _answer(self, request: Request) -> None:
        if not isinstance(request.message, ChunkRequest):
            self.server.reject(request, "a relay answers chunk_request only", "unexpected_type")
        elif request.role not in RELAY_CLIENTS:
            self.server.reject(request, f"role '{request.role or 'none'}' may not fetch weights", "forbidden_role")
        elif not self._try_send(request, time.monotonic()):
            self._held[request.identity] = (request, time.monotonic())

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
        if done <= message.first:
            if time.monotonic() - since < self.hold_s:
                return False
            self.server.reply(request, ChunkReply(message.version, message.first, 0))
            return True
        frames, size = [], 0
        for index in range(message.first, min(done, message.first + message.max_chunks)):
            view = copy.chunk_view(index)
            if frames and size + view.nbytes > MAX_REPLY_BYTES:
                break
            frames.append(bytes(view))  # a copy: the file may be reused once retired, a frame must not follow it
            size += view.nbytes
        self.server.reply(request, ChunkReply(message.version, message.first, len(frames)), payload=frames)
        self.counters["served_bytes"] += size
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class NoRelay:
    """A generator that cannot serve chunks (its relay could not bind or has no server key): a leaf of the tree."""

    address = ""

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
        self.store_dir = store_dir
        delete_orphaned_copies(store_dir)
        atexit.register(delete_copies, store_dir, generator_id)  # also when close() is never reached
        self.publisher = Client(address, security, identity=f"generator-{generator_id}-weights", role="generator")
        hold_s = weights.stall_timeout_s / 2
        self.relay = open_relay_server(weights.relay_host, security, hold_s, generator_id, toward=address)
        self.layout = LayoutGuard()
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
        try:
            check_layout(header)
            if header.transport == "relay":
                if header.chunk_bytes <= 0:
                    raise WeightsLayoutError(f"chunk_bytes {header.chunk_bytes} must be > 0")
                chunks = len(chunk_ranges(header.bucket_sizes, header.chunk_bytes))
                relayed = header.parent != "" and not header.parent.startswith(HOST_PREFIX)
                if len(header.chunk_digests) != (chunks if relayed else 0) and header.chunk_digests:
                    raise WeightsLayoutError(f"{len(header.chunk_digests)} digests for {chunks} chunks")
                if relayed and len(header.chunk_digests) != chunks:
                    raise WeightsLayoutError(
                        f"a relayed update needs {chunks} digests, {len(header.chunk_digests)} came"
                    )
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
        return reply[0]

    # --------------------------------------------------------------------------------------------- receiving
    def _receive(self, header: WeightsHeader) -> tuple[HostCopy, WeightsHeader]:
        """Until one copy of `header`'s version is complete: written here, or another host generator's."""
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
                    own = HostCopy.create(self.store_dir, header, self.generator_id)
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
            client = Client(address, self.security, identity=f"generator-{self.generator_id}-chunks", role="generator")
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
        self.counters["host_copies_mapped"] += 1
        return copy, None

    def close(self) -> None:
        self.relay.close()
        self.publisher.close()
        for client in self._parents.values():
            client.close()
        delete_copies(self.store_dir, self.generator_id)
