"""An append-only journal of the buffer's state changes, replayed on restart (`buffer.persist = true`).

File `<run_dir>/buffer/journal.bin`, a sequence of records:

    u64 payload length | u32 crc32(payload) | payload
    payload = u32 meta length | meta (msgpack map: {"k": kind, "fl": [frame lengths], ...}) | frames

Group records carry the group's wire frames (`common.wire.encode`) as they are, so replay decodes them with
the same validation as a socket. Each record is written with one `writev` before the buffer acts on it (and
before it replies), so a record the peer saw acknowledged survives the process being killed; records are not
fsync'ed one by one (a power loss may lose the last ones), the compacted file is.

Failure modes: a torn or corrupt record (bad length or CRC; a crash in mid-write leaves one at the end) stops
the replay there: it is logged, and the file is truncated to the last good record before appending resumes.
`rewrite` replaces the file by a compacted one (the live state only) with an atomic rename, so a crash during
compaction leaves either the old or the new file, never a mix.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

log = logging.getLogger("tandem.buffer.journal")

RECORD_HEADER = struct.Struct("<QI")
META_LENGTH = struct.Struct("<I")
Buffer = bytes | bytearray | memoryview


@dataclass
class Record:
    """One journal entry: `kind`, its plain `meta` values, and raw frames (views into the read file)."""

    kind: str
    meta: dict[str, Any]
    frames: list[memoryview]


def pack_record(kind: str, meta: dict[str, Any], frames: Sequence[Buffer] = ()) -> list[Buffer]:
    """The pieces of one record, ready for `writev` (frames are not copied)."""
    views = [memoryview(frame).cast("B") for frame in frames]
    head = msgpack.packb({**meta, "k": kind, "fl": [view.nbytes for view in views]}, use_bin_type=True)
    pieces: list[Buffer] = [META_LENGTH.pack(len(head)), head, *views]
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return [RECORD_HEADER.pack(sum(memoryview(p).nbytes for p in pieces), crc), *pieces]


def read_records(data: bytes) -> tuple[list[Record], int, str]:
    """Parse records from the start of `data`: (records, bytes of good records, why it stopped early or "")."""
    view = memoryview(data)
    records: list[Record] = []
    offset = 0
    while offset < len(view):
        if len(view) - offset < RECORD_HEADER.size:
            return records, offset, f"torn record header at byte {offset}"
        length, crc = RECORD_HEADER.unpack_from(view, offset)
        start, end = offset + RECORD_HEADER.size, offset + RECORD_HEADER.size + length
        if end > len(view) or length < META_LENGTH.size:
            return records, offset, f"torn record at byte {offset} (needs {length} bytes, {len(view) - start} left)"
        payload = view[start:end]
        if zlib.crc32(payload) != crc:
            return records, offset, f"corrupt record at byte {offset} (CRC mismatch)"
        record = _parse_payload(payload)
        if record is None:
            return records, offset, f"unreadable record at byte {offset} (bad meta)"
        records.append(record)
        offset = end
    return records, offset, ""


def _parse_payload(payload: memoryview) -> Record | None:
    (meta_length,) = META_LENGTH.unpack_from(payload, 0)
    try:
        meta = msgpack.unpackb(payload[META_LENGTH.size : META_LENGTH.size + meta_length], raw=False)
        kind, lengths = meta.pop("k"), meta.pop("fl")
    except Exception:  # noqa: BLE001 - a record that passed its CRC but does not parse: treat like corruption
        return None
    frames, position = [], META_LENGTH.size + meta_length
    for length in lengths:
        frames.append(payload[position : position + length])
        position += length
    if position != payload.nbytes:
        return None
    return Record(kind, meta, frames)


def _write_all(fd: int, pieces: list[Buffer]) -> int:
    """writev until every byte is written (a regular file takes all at once unless the disk is full)."""
    views = [memoryview(p).cast("B") for p in pieces]
    total = sum(v.nbytes for v in views)
    written = 0
    while views:
        count = os.writev(fd, views[:1024])
        written += count
        while views and count >= views[0].nbytes:
            count -= views[0].nbytes
            views.pop(0)
        if views and count:
            views[0] = views[0][count:]
    return total


class Journal:
    """The journal file: `replay()` once at start, then `append` records; `rewrite` compacts it.

    `needs_compaction` becomes true when the file is larger than both `min_compact_bytes` and `growth` times
    the size of the last compacted file, so the file stays within a constant factor of the live state.
    """

    def __init__(self, path: Path, min_compact_bytes: int = 256 << 20, growth: float = 2.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.min_compact_bytes, self.growth = min_compact_bytes, growth
        self.size = 0
        self.compacted_size = 0
        self.fd: int | None = None

    def replay(self) -> list[Record]:
        """Every good record of the file (empty if there is none); truncates a torn or corrupt tail."""
        if not self.path.exists():
            self._open()
            return []
        data = self.path.read_bytes()
        records, good, problem = read_records(data)
        if problem:
            log.error(
                "journal %s: %s; dropping the last %d bytes and resuming after record %d",
                self.path,
                problem,
                len(data) - good,
                len(records),
            )
            os.truncate(self.path, good)
        self._open()
        return records

    def _open(self) -> None:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.size = os.fstat(self.fd).st_size

    def append(self, kind: str, meta: dict[str, Any], frames: Sequence[Buffer] = ()) -> None:
        if self.fd is None:
            raise RuntimeError("journal: call replay() before append()")
        self.size += _write_all(self.fd, pack_record(kind, meta, frames))

    def retract(self, size: int) -> None:
        """Cut the file back to `size` bytes (its size before the last `append`): the record of an event that
        failed to apply live is taken back, so that a restart does not replay what broke the service."""
        if self.fd is None or not 0 <= size <= self.size:
            raise RuntimeError(f"journal: cannot retract to {size} bytes of {self.size}")
        os.ftruncate(self.fd, size)
        self.size = size

    @property
    def needs_compaction(self) -> bool:
        return self.size > max(self.min_compact_bytes, self.growth * self.compacted_size)

    def rewrite(self, records: Iterable[tuple[str, dict[str, Any], Sequence[Buffer]]]) -> None:
        """Replace the file by these records (the live state): write a temporary file, fsync, rename."""
        tmp = self.path.with_suffix(".compact")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            size = sum(_write_all(fd, pack_record(kind, meta, frames)) for kind, meta, frames in records)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self.close()
        self._open()
        self.compacted_size = size
        log.info("journal %s compacted to %.1f MB", self.path, size / 1e6)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
