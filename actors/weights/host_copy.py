"""Host copies of a weights update: one file per version in a store directory that the generators of a host share
(usually in /dev/shm), written by one generator and mapped by the others and by vLLM's workers (actors/weights/relay.py
says how the relay transport uses them).

    store = private_store_dir(directory)                         # this user's own, mode 0700, never a link
    copy = HostCopy.create(store, header, generator_id)          # the writer: chunks go in as they are checked
    copy.write_chunk(i, data); copy.chunk_view(i); copy.staged()
    other = HostCopy.open(store, header, writer_id)              # a reader: waits on "chunks done"
    delete_copies(store, generator_id, below_version)            # a writer's old copies; delete_orphaned_copies

A file: a 4 KiB header (magic, version, chunks done, chunk total, writer pid, abandoned), then the buckets at
`ALIGN`ed offsets (`copy_bytes`). Files are opened without following links, only when this user owns them.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import stat
import struct
from pathlib import Path
from typing import Any

from common.processes import pid_alive
from common.weight_messages import WeightsHeader
from common.weights import ALIGN, chunk_ranges, no_room

HEADER_BYTES = 4096
MAGIC = b"TNDMWGT1"
_FIELDS = struct.Struct("<8sqqqqq")  # magic, version, chunks done, chunk total, writer pid, abandoned
HOST_COPIES = 2  # a writer's copies at once: the version it receives and the one before, which engines may map
log = logging.getLogger("tandem.actors.host_copy")

COPY_NAME = re.compile(r"^v(\d+)-g(\d+)\.bin$")


class StoreDirError(RuntimeError):
    """The host-copy store directory is not this user's own (another user could replace the weights in it)."""


def private_store_dir(directory: Path) -> Path:
    """`directory`, created mode 0700 if absent; raises `StoreDirError` unless it is a real directory (not a link)
    that this process's user owns and nobody else may write: a directory another local user created first (the
    name is predictable) would let that user replace a finished host copy that the next generator maps."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    problem = ""
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = "is a symbolic link or not a directory"
    elif info.st_uid != os.getuid():
        problem = f"belongs to uid {info.st_uid}, not to this user (uid {os.getuid()})"
    elif info.st_mode & 0o022:
        problem = f"may be written by other users (mode {stat.filemode(info.st_mode)})"
    if problem:
        raise StoreDirError(
            f"the weights store {directory} {problem}: another user could replace the weights the generators map. "
            "Remove it (it is no run's of yours) or start the run from another run directory (run.run_dir)"
        )
    return directory


def _open_own(path: Path, flags: int) -> int:
    """A descriptor of `path`, never through a symbolic link, only for a regular file this user owns (else
    OSError)."""
    fd = os.open(path, flags | os.O_NOFOLLOW)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        os.close(fd)
        raise PermissionError(f"{path}: not a regular file of this user")
    return fd


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
        path = directory / f"v{header.policy_version}-g{generator_id}.bin"
        path.unlink(missing_ok=True)  # a copy this generator left before a restart
        size = copy_bytes(header)
        fd = _reusable(directory, generator_id, below_version=header.policy_version - 1)
        held = os.fstat(fd).st_blocks * 512 if fd is not None else 0  # a reused file's pages are overwritten
        short = no_room(directory, size, held)  # here, where the source placed the store (_place_store)
        if short is not None:
            if fd is not None:
                os.close(fd)
            raise OSError(short)
        if fd is not None:
            os.rename(_fd_path(fd), path)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.ftruncate(fd, size)
        # MAP_POPULATE for a reused file: the page tables are filled at once (its pages exist: ~65k minor faults per
        # 256 MiB saved), not one fault per 4 KiB page during the copy. A new file's pages come as chunks arrive:
        # a header announcing more than is sent costs the bytes sent, not the bytes announced.
        populate = getattr(mmap, "MAP_POPULATE", 0) if os.fstat(fd).st_blocks else 0
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
        copy = cls(path, header, fd, mapped, writer=True)  # takes LOCK_SH (from LOCK_EX if reused)
        copy._write_fields(done=0, abandoned=0)
        return copy

    @classmethod
    def open(cls, directory: Path, header: WeightsHeader, generator_id: int) -> HostCopy | None:
        """Another generator's copy of this version (None while it does not exist yet)."""
        path = directory / f"v{header.policy_version}-g{generator_id}.bin"
        try:
            fd = _open_own(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as error:  # a link, or a file another user put there: never mapped
            log.warning("weights: host copy %s refused: %s", path, error)
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
            fd = _open_own(path, os.O_RDWR)
        except OSError:
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


def copy_bytes(header: WeightsHeader) -> int:
    """The size of a host copy of `header`'s update: the header page, then the buckets at ALIGNed offsets."""
    starts = _bucket_starts(header.bucket_sizes)
    return (starts[-1] + header.bucket_sizes[-1]) if header.bucket_sizes else HEADER_BYTES


def held_bytes(directory: Path) -> int:
    """What the host copies in `directory` hold of its file system (the pages written, not the sizes announced)."""
    if not directory.is_dir():
        return 0
    return sum(path.lstat().st_blocks * 512 for path in directory.iterdir() if COPY_NAME.match(path.name))


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
            fd = _open_own(path, os.O_RDONLY)
            try:
                magic, _, _, _, pid, _ = _FIELDS.unpack(os.read(fd, _FIELDS.size))
            finally:
                os.close(fd)
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
