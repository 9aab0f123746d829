"""Serving loops that survive any one message: a fault while handling it is a rejection, and a serving thread that
dies anyway is restarted or takes its process down, loudly.

    while not stop:
        request = server.poll(timeout_ms=100)                 # decode faults: rejected inside poll
        if request is not None:
            answer_safely(server, request, handle)            # handle(request) raised: rejected, counted, logged

    thread = supervised_thread(serve_loop, name="weights-publisher")   # restarted after a fault, or the process exits

What holds: no exception raised while one message is decoded or handled leaves a `Server` loop. It is counted in
`server.rejected` under `internal_<ExceptionName>` (each service writes that counter to its metrics), logged with its
traceback once per kind per LOG_EVERY_S (`RateLimitedLog`; the lines in between are counted and summed up in the next
one), and the sender gets an `ErrorReply` of that kind. What the handler changed before it raised stays changed:
a handler must still order its checks before its effects (the buffer's journal, `buffers.state.BufferState.commit`,
takes back a record whose event failed to apply).

What does not hold: a fault outside the handling of a message (a bug in a loop's housekeeping, MemoryError, a thread
killed by the interpreter) ends the loop. `supervised_thread` restarts such a loop after a pause, at most
MAX_RESTARTS times in RESTART_WINDOW_S; past that it logs the fault as critical and exits the process with
EXIT_SERVING_THREAD_DIED, so a supervisor (`tandem run`, Ray, systemd) sees a dead role, never a half-alive one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, MutableMapping
from typing import Any

LOG_EVERY_S = 10.0  # one log line per kind of fault per this many seconds
MAX_RESTARTS = 5  # a serving thread restarted more often than this within RESTART_WINDOW_S takes its process down
RESTART_WINDOW_S = 60.0
RESTART_PAUSE_S = 0.5
EXIT_SERVING_THREAD_DIED = 70  # EX_SOFTWARE: the process's exit code when a serving thread cannot be kept alive

log = logging.getLogger("tandem.serving")


def fault_kind(error: BaseException) -> str:
    """The counter key of a fault: `internal_<ExceptionName>`."""
    return f"internal_{type(error).__name__}"


class RateLimitedLog:
    """Logs at most one line per kind per `every_s`; the lines it held back are counted into the next one."""

    def __init__(self, logger: logging.Logger, every_s: float = LOG_EVERY_S) -> None:
        self.logger = logger
        self.every_s = every_s
        self._next: dict[str, float] = {}
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def log(self, level: int, kind: str, message: str, *args: Any, exc_info: Any = None) -> bool:
        """Log `message % args` under `kind` unless one of that kind went out within `every_s`; True if it did."""
        now = time.monotonic()
        with self._lock:
            if now < self._next.get(kind, 0.0):
                self._held[kind] += 1
                return False
            self._next[kind] = now + self.every_s
            held = self._held.pop(kind, 0)
        if held:
            message += f" (and {held} more of this kind in the last {self.every_s:g}s)"
        self.logger.log(level, message, *args, exc_info=exc_info)
        return True


_faults = RateLimitedLog(log)


class _Rejecting:
    """What `answer_safely` needs of a `common.sockets.Server` (its name, and its rejection path)."""

    name: str

    def reject(self, request: Any, reason: str, kind: str = "refused") -> None: ...


def answer_safely(server: _Rejecting, request: Any, handle: Callable[[Any], Any]) -> bool:
    """`handle(request)`; any Exception it raises is a rejected message (module docstring). True if it returned."""
    try:
        handle(request)
        return True
    except Exception as error:  # noqa: BLE001 - deliberate: one message must not end the service (STYLE rule 7)
        name = getattr(type(request.message), "WIRE_NAME", type(request.message).__name__)
        kind = fault_kind(error)
        _faults.log(
            logging.ERROR,
            f"{server.name}:{kind}",
            "%s: internal error while handling a %s from %s (rejected, counted as rejected_%s)",
            server.name,
            name,
            getattr(request, "sender", "?"),
            kind,
            exc_info=error,
        )
        try:
            server.reject(request, f"internal error while handling {name}: {type(error).__name__}", kind)
        except Exception as reply_error:  # noqa: BLE001 - the reply to a message that broke us may break too
            _faults.log(logging.ERROR, f"{server.name}:reject", "%s: could not reject: %r", server.name, reply_error)
        return False


def count_fault(counter: MutableMapping[str, int], where: str, error: BaseException) -> None:
    """Count and log (rate-limited) a fault that did not belong to one message (e.g. a batch of them)."""
    kind = fault_kind(error)
    counter[kind] = counter.get(kind, 0) + 1
    _faults.log(logging.ERROR, f"{where}:{kind}", "%s: %s (counted as rejected_%s)", where, error, kind, exc_info=error)


# Set by common.sockets.release_context as the process lets go of its sockets: a serving thread whose socket is
# closed under it then ends quietly, instead of logging a death and restarting on a context that is gone.
PROCESS_ENDING = threading.Event()


def supervised_thread(
    target: Callable[[], None],
    name: str,
    stop: threading.Event | None = None,
    on_restart: Callable[[BaseException], None] | None = None,
) -> threading.Thread:
    """A started daemon thread that runs `target` until it returns (or `stop` is set); after an exception, it
    pauses RESTART_PAUSE_S and runs `target` again, at most MAX_RESTARTS times in RESTART_WINDOW_S, then exits the
    process with EXIT_SERVING_THREAD_DIED (module docstring). `on_restart(error)` runs before each restart."""

    def run() -> None:
        restarts: list[float] = []
        while True:
            try:
                target()
                return
            except BaseException as error:
                if (stop is not None and stop.is_set()) or PROCESS_ENDING.is_set():
                    return
                now = time.monotonic()
                restarts = [t for t in restarts if now - t < RESTART_WINDOW_S] + [now]
                if len(restarts) > MAX_RESTARTS:
                    die(f"serving thread {name!r} died {len(restarts)} times in {RESTART_WINDOW_S:g}s", error)
                log.error(
                    "serving thread %r died (restarting in %gs): %r", name, RESTART_PAUSE_S, error, exc_info=error
                )
                if on_restart is not None:
                    on_restart(error)
                time.sleep(RESTART_PAUSE_S)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def die(reason: str, error: BaseException | None = None) -> None:
    """Log `reason` as critical, flush the logs and end the process now with EXIT_SERVING_THREAD_DIED (from any
    thread: `sys.exit` would end only the calling thread and leave a half-alive process)."""
    log.critical("%s: exiting the process (code %d)", reason, EXIT_SERVING_THREAD_DIED, exc_info=error)
    logging.shutdown()
    os._exit(EXIT_SERVING_THREAD_DIED)
