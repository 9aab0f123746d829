"""The math verifier's worker processes: the worker's loop (`main`, run as a script) and the parent's pool of them
(`VerifierPool`, imported by common.math_reward). Both ends of the pipe protocol live here; the module imports the
standard library only (math_verify in the worker's `main`).

A worker compares answers with math-verify, one request a line, until stdin closes. `VerifierPool` starts it as
`python -P <this file> <parent pid>` with `subprocess` (run by path, not as `common.…`: `-P` keeps this folder off
sys.path, where common/types.py would shadow the standard library's `types`), so it imports only the standard library
and math_verify (with sympy and latex2sympy2_extended): never the parent's modules, never vLLM; and it is no fork of
the parent (which may hold vLLM), nor a re-import of the parent's main module (multiprocessing's spawn does that).
The parent kills it when a comparison passes its time limit (a huge power such as 9^{9^{9^{9}}} runs in C, holding
the GIL: nothing inside the process can stop it), so it keeps no state worth saving.

Protocol, UTF-8 JSON, one object a line:
    -> {"ready": true}                                   once, after the imports (or {"error": "..."} and exit 1)
    <- {"gold": "<ground truth>", "answer": "<answer>"}   each the text of one answer, as extracted (no `$`)
    -> {"equal": true | false}                           or {"error": "<type>: <message>"} for a request it cannot read

Both texts are parsed as the content of a `\\boxed{}` (math_verify.parse, LaTeX then plain expressions), then
math_verify.verify(gold, answer), which is not symmetric (the gold's `x = 3` matches an answer `3`, see its
docstring). math-verify's own timeouts (signal.alarm) are off: the parent times each request.
Failure modes: a text math-verify cannot parse compares unequal (math-verify returns []); its exceptions become
unequal too (raise_on_error=False); a MemoryError past the address-space limit below answers unequal.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import json
import logging
import os
import queue
import resource
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("tandem.common.math_reward")

# Address space of this process, at most: sympy's working set on contest answers is ~300 MB; an expression that
# allocates past 4 GiB (a power with a huge exponent) gets a MemoryError here instead of the host's memory.
ADDRESS_SPACE_BYTES = 4 << 30
PR_SET_PDEATHSIG = 1  # linux/prctl.h
STARTUP_TIMEOUT_S = 60.0  # a worker's imports, at most (sympy on a loaded machine)
PIP_HINT = "pip install 'tandem-rl[math]'"
WORKER_SCRIPT = Path(__file__)


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent dies (Linux): a worker stuck in one computation never
    reads the closed stdin that would end it otherwise."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's atexit kill is all there is
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def _limit_memory() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft > ADDRESS_SPACE_BYTES:  # never above the hard limit: hard >= soft
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, hard))


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> int:
    _die_with_parent(int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid())
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as error:
        _send({"error": f"ImportError: {error}"})
        return 1
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)  # per-parse warnings; the parent logs what matters
    logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
    _limit_memory()
    extraction = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())

    def parsed(text: str) -> list:
        return parse(f"\\boxed{{{text}}}", extraction_config=extraction, parsing_timeout=None)

    _send({"ready": True})
    for line in sys.stdin:
        try:
            request = json.loads(line)
            gold, answer = request["gold"], request["answer"]
            equal = bool(verify(parsed(gold), parsed(answer), timeout_seconds=None))
        except MemoryError:
            equal = False
        except (ValueError, KeyError, TypeError) as error:
            _send({"error": f"{type(error).__name__}: {error}"[:300]})
            continue
        _send({"equal": equal})
    return 0


# -------------------------------------------------------------------------------------- worker processes


class _Worker:
    """One math_verify_worker process and its pipes; one caller at a time (the pool hands it out)."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-P", str(WORKER_SCRIPT), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
        )
        self.ready = False
        self._buffer = b""
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.process.stdout, selectors.EVENT_READ)

    def _read_line(self, deadline: float) -> dict | None:
        """The next JSON line, or None past `deadline` (time.monotonic). Raises RuntimeError when the worker exited."""
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not self._selector.select(left):
                return None
            chunk = os.read(self.process.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError(f"the math verifier's worker exited (status {self.process.wait()})")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def wait_ready(self) -> None:
        if self.ready:
            return
        message = self._read_line(time.monotonic() + STARTUP_TIMEOUT_S)
        if message is None:
            raise RuntimeError(f"the math verifier's worker did not start within {STARTUP_TIMEOUT_S:g}s")
        if "error" in message:
            raise ImportError(f"the math verifier's worker cannot start: {message['error']} ({PIP_HINT})")
        self.ready = True

    def equal(self, gold: str, answer: str, timeout_s: float) -> bool | None:
        """Whether math-verify calls `answer` equal to `gold`; None past `timeout_s` (the caller kills the worker)."""
        self.process.stdin.write(json.dumps({"gold": gold, "answer": answer}).encode() + b"\n")
        self.process.stdin.flush()
        message = self._read_line(time.monotonic() + timeout_s)
        if message is None:
            return None
        if "error" in message:
            raise RuntimeError(f"the math verifier's worker refused a request: {message['error']}")
        return bool(message["equal"])

    def kill(self) -> None:
        self._selector.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:  # a broken pipe to a killed worker: nothing left to flush
                pass


def _launch_forever(requests: queue.SimpleQueue) -> None:
    """The pool's launcher thread: starts a worker for each future put in `requests`. Workers are started here, on
    a thread that lives as long as the process, because PR_SET_PDEATHSIG fires when the *thread* that started a
    child ends: started from a caller's thread (a TimedFunction worker, replaced after a timeout), they would die
    with it."""
    while True:
        future = requests.get()
        try:
            future.set_result(_Worker())
        except BaseException as error:  # noqa: BLE001 - handed to the caller (an OSError from Popen, say)
            future.set_exception(error)


class VerifierPool:
    """Up to `size` workers, started on demand and kept; a comparison past its limit kills its worker and puts a
    fresh one in its place (importing in the background while the caller returns). Thread-safe: a caller takes an
    idle worker, or starts one while fewer than `size` exist, or waits for one. Workers are started by one launcher
    thread (`_launch_forever`)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self.counts = {"compared": 0, "timeouts": 0, "restarts": 0}
        self._launches: queue.SimpleQueue = queue.SimpleQueue()
        self._launcher: threading.Thread | None = None

    def _new_worker(self) -> _Worker:
        """A worker started by the launcher thread (started first if need be). Called with self._lock held."""
        if self._launcher is None:
            self._launcher = threading.Thread(
                target=_launch_forever, args=(self._launches,), name="math-verifier-launcher", daemon=True
            )
            self._launcher.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._launches.put(future)
        return future.result()

    def _take(self) -> _Worker:
        while True:
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                if len(self._workers) < self.size:
                    worker = self._new_worker()
                    self._workers.append(worker)
                    return worker
            try:  # all busy: one comes back within its call's limit (or is replaced); recheck after a while
                return self._idle.get(timeout=1.0)
            except queue.Empty:
                continue

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            mine = worker in self._workers  # not after close(), which killed it
        if mine:
            self._idle.put(worker)

    def _replace(self, worker: _Worker) -> None:
        """Kill `worker` and start a fresh one in its place (unless close() took it already)."""
        worker.kill()
        with self._lock:
            if worker not in self._workers:
                return
            self._workers.remove(worker)
            self.counts["restarts"] += 1
            fresh = self._new_worker()
            self._workers.append(fresh)
        self._idle.put(fresh)

    def equal(self, gold: str, answer: str, timeout_s: float) -> bool | None:
        """See `_Worker.equal`; None when it ran past `timeout_s` (its worker replaced). Raises ImportError when
        a worker cannot import math_verify, RuntimeError when one does not start or dies (it is replaced)."""
        worker = self._take()
        try:
            worker.wait_ready()
            result = worker.equal(gold, answer, timeout_s)
        except BaseException:
            self._replace(worker)
            raise
        with self._lock:
            self.counts["compared"] += 1
        if result is None:
            self._replace(worker)
            with self._lock:
                self.counts["timeouts"] += 1
                first = self.counts["timeouts"] == 1
            if first:
                log.warning(
                    "math verifier: a comparison ran past timeout_s = %gs (gold %.80r, answer %.80r): scored 0 and "
                    "its worker restarted; later timeouts are counted in common.math_reward.stats(), not logged",
                    timeout_s,
                    gold,
                    answer,
                )
            return None
        self._give_back(worker)
        return result

    def close(self) -> None:
        """Kill every worker (idle or not); the pool starts new ones if used again."""
        with self._lock:
            workers, self._workers = self._workers, []
        try:
            while True:
                self._idle.get_nowait()
        except queue.Empty:
            pass
        for worker in workers:
            worker.kill()


if __name__ == "__main__":
    sys.exit(main())
