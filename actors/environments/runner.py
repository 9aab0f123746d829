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
engine steps. `async def` methods run on the runner's event loop (thousands may wait at once, and they may share
async resources: one loop); plain functions run in `workers` threads and report straight from their thread, so a
stalled loop cannot hold them. Both are bounded by `timeout_s`, counted from submission, and enforced by a
watchdog thread, not by the loop: a call ends on time even while the loop is held.

Failure modes (deliberately survived; the caller counts them; no plug-in can end the loop or the generator):
  * whatever the call raises, any BaseException included (SystemExit, KeyboardInterrupt, GeneratorExit, a custom
    subclass, a CancelledError it raised itself), becomes `outcome.error` ("Type: message"). A task the plug-in
    started itself is wrapped too: a BaseException there becomes `PluginAbort` (an Exception) for its awaiter, and
    one that still escapes the loop (from a bare callback) is counted in `loop_escapes` and the loop serves on.
  * an overrun becomes `outcome.timed_out`. An async call that overruns is cancelled; a plain function cannot be
    interrupted: its thread keeps running until it returns (`stuck_calls` counts those) and its result is
    discarded. Worker threads are daemons: a call stuck forever does not keep the process from exiting.
  * a blocking call inside async code (time.sleep in `async def step`) holds the shared loop. The watchdog sees the
    loop's current step run past `block_warn_s`, logs the plug-in call that holds it (its name and the line it
    blocks at) and times out that plug-in's calls at their own deadline; every other call's deadline is moved by
    the time the loop was held by others, so they are delayed, not failed. `loop_blocks` / `loop_blocked_s`
    count it (env/loop_blocks, env/loop_blocked_s).
"""

from __future__ import annotations

import asyncio
import collections.abc
import concurrent.futures
import contextvars
import functools
import heapq
import inspect
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tandem.actors.env_runner")

BLOCK_WARN_S = 1.0  # a loop step of a plug-in longer than this is a blocking call in async code: logged, counted
LAG_STEP_S = 0.05  # a loop step at least this long holds the others: it moves their deadlines
MAX_OWNERS = 4096  # environments whose share of the loop's lag is remembered
WATCH_S = 0.02  # how often the watchdog looks at deadlines and at the loop


@dataclass(frozen=True)
class CallOutcome:
    """How an environment call ended: exactly one of value (error is None, not timed_out), error, timed_out."""

    value: Any = None
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0  # from submission to the outcome


class PluginAbort(Exception):
    """What a task of a plug-in raised instead of a BaseException (SystemExit, KeyboardInterrupt, ...) that would
    otherwise stop the runner's event loop; `original` is that exception."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {original}")
        self.original = original


def _describe(error: BaseException) -> str:
    original = error.original if isinstance(error, PluginAbort) else error
    return f"{type(original).__name__}: {original}"[:500]


@dataclass(eq=False)
class _Call:
    """One submitted call, as the watchdog and the loop see it."""

    label: str  # the plug-in's name: module.Class.method
    owner: int  # id of the environment instance (or of the function): its tasks' blocking is its own
    submitted: float  # monotonic
    timeout_s: float
    lag_at_submit: float  # runner.lag_s then
    own_lag_at_submit: float  # what `owner` had held the loop for then
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    task: asyncio.Task | None = None  # the async call's task on the loop
    thread: concurrent.futures.Future | None = None  # the plain call's run in a worker
    on_loop: bool = False  # its deadline moves with the time others hold the loop

    def settle(self, outcome: CallOutcome) -> bool:
        """The outcome, unless one was settled already (the watchdog and the call race); True when this one."""
        try:
            self.future.set_result(outcome)
        except concurrent.futures.InvalidStateError:
            return False
        return True


_CURRENT: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("tandem_env_call", default=None)


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
        """Call `callback()` (from the runner's threads) once the call is done; at once if it already is."""
        self._future.add_done_callback(lambda _: callback())

    def cancel(self) -> None:
        """Stop waiting for it (an async call is cancelled; a plain function finishes in its thread, unread)."""
        self._future.cancel()


class _Traced(collections.abc.Coroutine):
    """A task's coroutine, stepped under the runner's eye: each step is timed and attributed to the plug-in call
    that created the task, and a BaseException it raises (but the task's own cancellation) becomes PluginAbort."""

    def __init__(self, coro: Any, call: _Call | None, runner: EnvRunner) -> None:
        self._coro, self._call, self._runner = coro, call, runner
        self.__qualname__ = getattr(coro, "__qualname__", type(coro).__qualname__)

    def send(self, value: Any) -> Any:
        return self._step(lambda: self._coro.send(value))

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if val is None and tb is None:
            return self._step(lambda: self._coro.throw(typ))
        return self._step(lambda: self._coro.throw(typ, val, tb))

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:
        return self._coro.__await__()

    def _step(self, resume: Callable[[], Any]) -> Any:
        runner = self._runner
        runner.running, runner.step_started = self._call, time.monotonic()
        try:
            return resume()
        except (Exception, asyncio.CancelledError):
            raise
        except BaseException as error:  # a plug-in's SystemExit & co. must not stop the loop
            raise PluginAbort(error) from error
        finally:
            runner.running = None
            runner.stepped(self._call, time.monotonic() - runner.step_started)


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

    def __init__(self, workers: int, block_warn_s: float = BLOCK_WARN_S) -> None:
        self.block_warn_s = block_warn_s
        self._pool = _DaemonThreadPool(workers, "tandem-env")
        self._loop = asyncio.new_event_loop()
        self._loop.set_task_factory(self._task)
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._deadlines: list[tuple[float, int, _Call]] = []  # heap of (submitted + timeout_s, seq, call)
        self._overdue: list[_Call] = []  # past their own deadline, moved on by the time others held the loop
        self._seq = 0
        self.running: _Call | None = None  # the call whose task the loop is stepping now (None: between steps)
        self.step_started = 0.0
        self.lag_s = 0.0  # the loop's time in steps of >= LAG_STEP_S, all calls together
        self._own_lag: dict[int, float] = {}  # owner -> its share of lag_s (only owners that held the loop)
        self._reported: _Call | None = None  # the call whose ongoing block the watchdog logged
        self.stuck_calls = 0  # plain-function calls that timed out and still run in their thread
        self.loop_blocks = 0  # loop steps of a plug-in longer than block_warn_s
        self.loop_blocked_s = 0.0  # their total length
        self.loop_escapes = 0  # BaseExceptions that left the loop anyway (it was restarted)
        self._thread = threading.Thread(target=self._serve, name="tandem-env-loop", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch, name="tandem-env-watchdog", daemon=True)
        self._watchdog.start()

    # ------------------------------------------------------------------------------------------------ interface
    def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> EnvCall:
        """Submit `fn(*args)` (plain or async); returns at once. `timeout_s` <= 0 times out at once."""
        owner = getattr(fn, "__self__", fn)
        label = f"{type(owner).__module__}.{type(owner).__qualname__}.{getattr(fn, '__name__', '?')}"
        if owner is fn:
            label = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        now = time.monotonic()
        call = _Call(label, id(owner), now, timeout_s, self.lag_s, self._own_lag.get(id(owner), 0.0))
        call.future.add_done_callback(lambda _: self._finished.set())
        with self._lock:
            self._seq += 1
            heapq.heappush(self._deadlines, (now + timeout_s, self._seq, call))
        if inspect.iscoroutinefunction(fn):
            self._on_loop(call, fn, args)
        else:
            call.thread = self._pool.submit(fn, *args)
            call.thread.add_done_callback(lambda thread: self._from_thread(call, fn, thread))
        return EnvCall(call.future)

    def wait(self, timeout_s: float) -> None:
        """Sleep until a call finishes after the last `wait`, or `timeout_s` passes."""
        self._finished.wait(timeout_s)
        self._finished.clear()

    def close(self) -> None:
        """Cancel the calls still waited for, stop the event loop and release idle workers; threads stuck in a call
        are not waited for (they are daemons). Idempotent. The loop is left open: a stuck call that returns later
        still reports to it harmlessly."""
        if self._closing.is_set():
            return
        self._closing.set()
        with self._lock:
            pending = [call for _, _, call in self._deadlines] + self._overdue
        for call in pending:
            call.future.cancel()
        try:
            asyncio.run_coroutine_threadsafe(_cancel_pending(), self._loop).result(timeout=5)
        except (concurrent.futures.TimeoutError, RuntimeError):  # the loop is wedged by a blocking async call
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._watchdog.join(timeout=1)
        self._pool.shutdown(wait=False)

    # -------------------------------------------------------------------------------------------- the calls
    def _on_loop(self, call: _Call, fn: Callable[..., Any], args: tuple) -> None:
        """Start `fn(*args)` as a task on the loop, in a context that names `call` (its own tasks inherit it)."""
        call.on_loop = True
        context = contextvars.copy_context()
        context.run(_CURRENT.set, call)
        self._loop.call_soon_threadsafe(self._start, call, fn, args, context=context)

    def _start(self, call: _Call, fn: Callable[..., Any], args: tuple) -> None:
        if not call.future.done():  # timed out or cancelled before the loop got to it
            call.task = self._loop.create_task(self._run(call, fn, args))

    async def _run(self, call: _Call, fn: Callable[..., Any], args: tuple) -> None:
        try:
            value = fn(*args)
            while inspect.isawaitable(value):
                value = await value
        except asyncio.CancelledError as error:
            if asyncio.current_task().cancelling():  # ours: the watchdog timed it out, or close
                raise
            call.settle(self._outcome(call, error=_describe(error)))  # the plug-in raised it itself
        except BaseException as error:  # noqa: BLE001 - an environment may raise anything: the caller records it
            call.settle(self._outcome(call, error=_describe(error)))
        else:
            call.settle(self._outcome(call, value=value))

    def _from_thread(self, call: _Call, fn: Callable[..., Any], thread: concurrent.futures.Future) -> None:
        """A plain call returned (in its worker thread): settle it there, or await what it returned on the loop."""
        if thread.cancelled():
            return
        error = thread.exception()
        if error is not None:
            call.settle(self._outcome(call, error=_describe(error)))
        elif inspect.isawaitable(value := thread.result()):  # a plain function that returned a coroutine
            self._on_loop(call, lambda: value, ())
        else:
            call.settle(self._outcome(call, value=value))

    @staticmethod
    def _outcome(call: _Call, **fields: Any) -> CallOutcome:
        return CallOutcome(**fields, seconds=time.monotonic() - call.submitted)

    # ----------------------------------------------------------------------------------- the loop and its watch
    def _task(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task:
        """The loop's task factory: every task, the plug-ins' own included, is stepped through `_Traced`."""
        return asyncio.Task(_Traced(coro, _CURRENT.get(), self), loop=loop, **kwargs)

    def _serve(self) -> None:
        """Run the loop until `close`; a BaseException that leaves it anyway (a plug-in's callback) is counted and
        logged, and the loop serves on."""
        asyncio.set_event_loop(self._loop)
        while True:
            try:
                self._loop.run_forever()
                return
            except BaseException as error:  # noqa: BLE001 - one plug-in must not stop every environment call
                self.loop_escapes += 1
                log.error("an environment's %s left the event loop; it serves on", _describe(error))
                if self._closing.is_set():
                    return

    def stepped(self, call: _Call | None, seconds: float) -> None:
        """A loop step of `call`'s task took `seconds` (called on the loop, by `_Traced`)."""
        if seconds < LAG_STEP_S:
            return
        self.lag_s += seconds
        if call is not None:
            if len(self._own_lag) > MAX_OWNERS:  # bounded memory; a forgotten share only moves a deadline less
                self._own_lag.clear()
            self._own_lag[call.owner] = self._own_lag.get(call.owner, 0.0) + seconds
        if seconds >= self.block_warn_s:
            self.loop_blocks += 1
            self.loop_blocked_s += seconds
            name = call.label if call is not None else "a task of no environment call"
            log.warning(
                "%s held the environments' event loop for %.1f s: a blocking call in async code (every other "
                "async environment waited; make it a plain def, or await it)",
                name,
                seconds,
            )

    def _deadline(self, call: _Call, now: float) -> float:
        """`call`'s deadline: its timeout after submission, plus (for a call on the loop) the time other calls held
        the loop meanwhile, the step running now included."""
        deadline = call.submitted + call.timeout_s
        if not call.on_loop:
            return deadline
        others = (self.lag_s - call.lag_at_submit) - (self._own_lag.get(call.owner, 0.0) - call.own_lag_at_submit)
        running = self.running
        if running is not None and running.owner != call.owner:
            others += max(0.0, now - self.step_started)
        return deadline + max(0.0, others)

    def _watch(self) -> None:
        while not self._closing.wait(WATCH_S):
            now = time.monotonic()
            self._report_block(now)
            with self._lock:
                while self._deadlines and self._deadlines[0][0] <= now:
                    self._overdue.append(heapq.heappop(self._deadlines)[2])
                overdue, self._overdue = self._overdue, []
            late = []
            for call in overdue:
                if call.future.done():
                    continue
                if now < self._deadline(call, now):
                    late.append(call)
                else:
                    self._time_out(call)
            with self._lock:
                self._overdue.extend(late)

    def _time_out(self, call: _Call) -> None:
        if not call.settle(self._outcome(call, timed_out=True)):
            return
        if call.task is not None:  # (an async call not started yet never starts: `_start` sees it settled)
            self._loop.call_soon_threadsafe(call.task.cancel)
        elif call.thread is not None and not call.thread.done():
            self._count_stuck(call.thread)

    def _report_block(self, now: float) -> None:
        """Log, once per block, the plug-in call holding the loop past `block_warn_s` and the line it is at."""
        running = self.running
        if running is None or now - self.step_started < self.block_warn_s or running is self._reported:
            return
        self._reported = running
        log.warning(
            "%s has held the environments' event loop for %.1f s, at %s: a blocking call in async code",
            running.label,
            now - self.step_started,
            _where(self._thread.ident),
        )

    def _count_stuck(self, thread: concurrent.futures.Future) -> None:
        with self._lock:
            self.stuck_calls += 1

        def released(_: Any) -> None:
            with self._lock:
                self.stuck_calls -= 1

        thread.add_done_callback(released)


def _where(thread_id: int | None) -> str:
    """The innermost frame of that thread outside asyncio and this module: `file:line in function`."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    while frame is not None:
        filename = frame.f_code.co_filename
        if "asyncio" not in filename and not filename.endswith("env_runner.py"):
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_qualname}"
        frame = frame.f_back
    return "an unknown place"


async def _cancel_pending() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
