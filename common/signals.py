"""Ctrl-C and SIGTERM noted, not obeyed at once, by a process that must first stop what it started.

    with caught_signals() as received:      # SIGINT, SIGTERM: appended to `received` as they arrive
        while not received: ...             # the loop sees them and stops its children in order
    # the previous handlers are back here

Used by the launchers (`tandem run`, `tandem ray`) and the torchrun parent of the learner ranks, each of which
must outlive its children's shutdown instead of dying on the first signal.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def caught_signals(*signums: int) -> Iterator[list[int]]:
    """For the body, record `signums` (default SIGINT and SIGTERM) in the order received instead of their usual
    action; the previous handlers are restored on exit, however the body ends. Main thread only (Python delivers
    signals there, and signal.signal raises ValueError elsewhere)."""
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _f: received.append(s)) for sig in signums or DEFAULT}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


DEFAULT = (signal.SIGINT, signal.SIGTERM)
