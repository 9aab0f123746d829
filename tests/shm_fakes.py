"""A /dev/shm of a chosen free size, in a temporary folder: what a container's 64 MiB /dev/shm looks like to
common.weights (which reads free space with os.statvfs)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from common import weights


def small_shared_memory(monkeypatch: pytest.MonkeyPatch, root: Path, free_bytes: int) -> tuple[Path, Path]:
    """(shared memory, temporary directory): `root/shm` stands for /dev/shm with `free_bytes` free (statvfs), and
    `root/tmp` for the temporary directory, with the real free space of `root`'s file system."""
    shm, tmp = root / "shm", root / "tmp"
    shm.mkdir()
    tmp.mkdir()
    real = os.statvfs

    def statvfs(path: str | os.PathLike[str]) -> object:
        if Path(path).is_relative_to(shm):
            return SimpleNamespace(f_bavail=free_bytes, f_frsize=1)
        return real(path)

    monkeypatch.setattr(os, "statvfs", statvfs)
    monkeypatch.setattr(weights, "SHARED_MEMORY", shm, raising=False)  # not raising: the parent code, faked alike
    monkeypatch.setattr(weights, "_said", set(), raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return shm, tmp
