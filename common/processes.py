"""What every role asks about other processes on this machine."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user counts: signalling it is refused, it exists).
    A zombie counts as alive here; `launch.ray.local.process_alive` tells it apart where that matters."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
