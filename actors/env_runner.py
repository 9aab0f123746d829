"""Environment calls off the generator's loop: one asyncio event loop in a thread, plain functions in a thread pool.

    runner = EnvRunner(workers=32)
    call = runner.call(env.step, text, timeout_s=30.0)     # returns at once
    ...                                                     # the engine keeps stepping
    if call.done():
        outcome = call.outcome()                            # .value, or .error / .timed_out; .seconds
    runner.wait(0.02)                                       # sleep until some call finishes (or the timeout)
    runner.close()

Why: an environment may take seconds per step (a tool, a sandboxed test run, a remote service). The engine must
keep sampling the other episodes meanwhile, so every call runs elsewhere and the driver polls `done()` between
engine steps. `async def` methods run on the runner's event loop (thousands may wait at once); plain functions run
in `workers` threads. Both are bounded by `timeout_s`, counted from submission.

Failure modes (deliberately survived; the caller counts them): whatever the call raises becomes `outcome.error`
("Type: message"); an overrun becomes `outcome.timed_out`. An async call that overruns is cancelled; a plain
function cannot be interrupted: its thread keeps running until it returns (`stuck_calls` counts those) and its
result is discarded. Worker threads are daemons: a call stuck forever does not keep the process from exiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CallOutcome:
    """How an environment call ended: exactly one of value (error is None, not timed_out), error, timed_out."""

    value: Any = None
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0  # from submission to the outcome


class EnvCall:
    """One submitted call; poll `done()`, then read `outcome()` once done."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def outcome(self) -> CallOutcome:
        """The outcome of a done call (raises RuntimeError while it runs)."""
        if not self._future.done():
            raise RuntimeError("EnvCall.outcome() before done()")
        return self._future.result()

    def on_done(self, callback: Callable[[], None]) -> None:
        """Call `callback()` (from the runner's thread) once the call is done; at once if it already is."""
        self._future.add_done_callback(lambda _: callback())

    def cancel(self) -> None:
        """Stop waiting for it (an async call is cancelled; a plain function finishes in its thread, unread)."""
        self._future.cancel()


class _DaemonThreadPool(concurrent.futures.Executor):
    """A fixed pool of DAEMON threads. The standard ThreadPoolExecutor joins its threads at interpreter exit, so an
    environment call stuck forever would keep the generator from exiting; these threads are abandoned instead."""

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = workers
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, functools.partial(fn, *args, **kwargs)))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as error:  # noqa: BLE001 - handed to the waiting caller, which records it
                future.set_exception(error)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for _ in range(self._workers):
            self._queue.put(None)  # one stop marker per worker: idle ones exit now, busy ones after their call


class EnvRunner:
    """Runs environment calls concurrently with the caller (see the module docstring). Thread-safe `call`."""

    def __init__(self, workers: int) -> None:
        self._pool = _DaemonThreadPool(workers, "tandem-env")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-env-loop", daemon=True)
        self._thread.start()
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self.stuck_calls = 0  # plain-function calls that timed out and still run in their thread

    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> EnvCall:
        """Submit `fn(*args)` (plain or async); returns at once. `timeout_s` <= 0 times out at once."""
        future = asyncio.run_coroutine_threadsafe(self._run(fn, args, timeout_s, time.monotonic()), self._loop)
        future.add_done_callback(lambda _: self._finished.set())
        return EnvCall(future)

    def wait(self, timeout_s: float) -> None:
        """Sleep until a call finishes after the last `wait`, or `timeout_s` passes."""
        self._finished.wait(timeout_s)
        self._finished.clear()

    async def _run(self, fn: Callable[..., Any], args: tuple, timeout_s: float, submitted: float) -> CallOutcome:
        remaining = lambda: max(0.0, timeout_s - (time.monotonic() - submitted))
        in_thread: asyncio.Future | None = None
        try:
            if inspect.iscoroutinefunction(fn):
                value = await asyncio.wait_for(fn(*args), remaining())
            else:
                in_thread = self._loop.run_in_executor(self._pool, functools.partial(fn, *args))
                value = await asyncio.wait_for(asyncio.shield(in_thread), remaining())
                if inspect.isawaitable(value):  # a plain function that returned a coroutine
                    value = await asyncio.wait_for(value, remaining())
        except TimeoutError:
            if in_thread is not None and not in_thread.done():
                self._count_stuck(in_thread)
            return CallOutcome(timed_out=True, seconds=time.monotonic() - submitted)
        except Exception as error:  # noqa: BLE001 - an environment may raise anything: the caller records it
            return CallOutcome(error=f"{type(error).__name__}: {error}"[:500], seconds=time.monotonic() - submitted)
        return CallOutcome(value=value, seconds=time.monotonic() - submitted)

    def _count_stuck(self, in_thread: asyncio.Future) -> None:
        with self._lock:
            self.stuck_calls += 1

        def released(_: Any) -> None:
            with self._lock:
                self.stuck_calls -= 1

        in_thread.add_done_callback(released)

    def close(self) -> None:
        """Cancel the calls still waited for, stop the event loop and release idle workers; threads stuck in a call
        are not waited for (they are daemons). Idempotent. The loop is left open: a stuck call that returns later
        still reports to it harmlessly."""
        if not self._thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(_cancel_pending(), self._loop).result(timeout=5)
        except (concurrent.futures.TimeoutError, RuntimeError):  # the loop is wedged by a blocking async call
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False)


async def _cancel_pending() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
