"""Run untrusted Python (a model's code and the tests that judge it) in a sandboxed subprocess.

    result = run_python("print(sum(range(10)))", files={"solution.py": code}, limits=SandboxLimits(time_s=5))
    result.returncode, result.stdout, result.stderr, result.timed_out, result.output_exceeded, result.isolation

What confines the process (`actors/environments/sandbox_boot.py` sets it up before the first untrusted line runs; it holds as
root, which is how roles run on these machines and in most containers):
  * kernel namespaces: its own PID namespace (it is PID 1 there and sees no other process, so it can signal none),
    mount, network (only a down loopback: no route anywhere), IPC, UTS and cgroup namespaces, and a user namespace
    when the caller is not root;
  * a private root: /usr, /bin, /lib* and the interpreter's prefix read-only, a fresh /proc of its own PID
    namespace, a minimal /dev; nothing else of the host exists there (no repository, no key files, no /root, no
    /etc, no other process's /proc); `/` read-only;
  * one size-capped tmpfs (`disk_mb`) for the working directory (HOME, /tmp/<name>), /tmp and a private /dev/shm:
    the only places it can write, discarded when it exits (only stdout and stderr come back);
  * uid/gid 65534 (nobody) with no supplementary groups when the caller is root, every capability gone (bounding
    set included), PR_SET_NO_NEW_PRIVS, and a seccomp filter on x86-64 (no setns, unshare, mount, ptrace, bpf,
    keyctl, perf_event_open, exec, fork and the like);
  * no inherited environment (PATH, HOME and LANG only) and `python -I -S` (the standard library only);
  * limits: wall clock `time_s` (then it is killed), CPU seconds, address space (`memory_mb`: an allocation beyond
    it raises MemoryError), file size, open files, no core dumps; stdout and stderr are read as they come and the
    process is killed once they exceed `output_bytes` together (`result.output_exceeded`): the caller never holds
    more than that;
  * an audit hook as defence in depth (sockets, writes outside the working directory, subprocesses, signals,
    ctypes, subinterpreters).
`result.isolation` reports what was granted: {"mode": "namespaces", "uid": ..., "capeff": ..., "seccomp": ...}.

Where the kernel grants no namespaces (not root, and no unprivileged user namespaces), `run_python` raises
`SandboxUnavailable` rather than running with less: the audit hook alone stops ordinary code, not code that
tampers with the interpreter. `SandboxLimits(allow_audit_hook_only=True)` opts in to that weaker mode
(`result.isolation["mode"] == "audit_hook_only"`: still nobody with no capabilities when root, but the host's
file system is visible and the disk is not capped), for machines whose container already isolates the generator.

Thread-safe (no preexec_fn): environment steps may call `run_python` from many threads at once.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

BOOT = Path(__file__).with_name("sandbox_boot.py")
READ_CHUNK = 64 * 1024  # bytes read from a pipe at a time: the most held beyond `output_bytes`
SETUP_FAILED = 70  # the boot's exit status when confinement failed (see sandbox_boot)


class SandboxUnavailable(RuntimeError):
    """The kernel would not confine the sandbox and the caller did not opt in to the audit hook alone."""


@dataclass(frozen=True)
class SandboxLimits:
    time_s: float = 5.0  # wall clock, from the start of the interpreter to its exit
    memory_mb: int = 512  # address space
    file_size_mb: int = 16  # largest file it may write
    disk_mb: int = 64  # the tmpfs of its working directory, /tmp and /dev/shm together (host memory, freed at exit)
    output_bytes: int = 1 << 20  # stdout + stderr together; beyond it the process is killed
    max_open_files: int = 64
    allow_audit_hook_only: bool = False  # run with the audit hook alone where the kernel grants no namespaces
    audit_hook: bool = True  # the defence-in-depth layer; False only to test the kernel layers alone

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.type in ("float", "int") and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"SandboxLimits.{spec.name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None when killed at the time or output limit
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    isolation: dict[str, str] = field(default_factory=dict)  # what was granted (see the module docstring)
    output_exceeded: bool = False  # killed for writing more than `output_bytes`; the output kept is what came first

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.output_exceeded


def run_python(
    source: str, files: dict[str, str] | None = None, limits: SandboxLimits = SandboxLimits(), stdin: str = ""
) -> SandboxResult:
    """Run `source` as `__main__` in the sandbox, with `files` (name -> text) written beside it first.

    Never raises for what the code does (errors, timeouts, limits show in the result). Raises ValueError for a file
    name that leaves the directory or files larger than `disk_mb`, SandboxUnavailable where the kernel grants no
    isolation (see the module docstring for the opt-in), OSError if the interpreter cannot be started at all.
    """
    size = sum(len(text.encode()) for text in (files or {}).values()) + len(source.encode())
    if size > limits.disk_mb << 20:
        raise ValueError(f"the sandbox's files hold {size} bytes, more than SandboxLimits.disk_mb={limits.disk_mb}")
    with tempfile.TemporaryDirectory(prefix="tandem-sandbox-") as directory:
        root = Path(directory).resolve()
        _write_files(root / "files", {**(files or {}), "main.py": source})
        (root / "mnt").mkdir()
        result = _run_boot(root, limits, "namespaces", stdin)
        if "error" in result.isolation:
            if not limits.allow_audit_hook_only:
                raise SandboxUnavailable(
                    f"{result.isolation['error']}. The sandbox needs root or unprivileged user namespaces "
                    "(sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone = 1); to run with the "
                    "audit hook alone, opt in with SandboxLimits(allow_audit_hook_only=True)"
                )
            result = _run_boot(root, limits, "audit_hook_only", stdin)
            if "error" in result.isolation:
                raise SandboxUnavailable(result.isolation["error"])
    return result


def _write_files(directory: Path, files: dict[str, str]) -> None:
    directory.mkdir()
    for name, text in files.items():
        target = (directory / name).resolve()
        if directory not in target.parents:
            raise ValueError(f"sandbox file name {name!r} must stay inside the sandbox directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)


def _run_boot(root: Path, limits: SandboxLimits, mode: str, stdin: str) -> SandboxResult:
    """One boot of the sandbox in `mode`; the result's isolation holds {"error"} when confinement failed."""
    options = [f"{name}={int(value) if isinstance(value, bool) else value}" for name, value in asdict(limits).items()]
    command = [sys.executable, "-I", "-S", str(BOOT), str(root), *options, f"mode={mode}"]
    environment = {"PATH": "/usr/bin:/bin", "HOME": str(root / "files"), "LANG": "C.UTF-8"}
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=root,
        env=environment,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        stdout, stderr, stopped = _collect(process, stdin.encode(), started + limits.time_s, limits.output_bytes)
        if stopped is None:
            try:
                process.wait(timeout=max(0.0, started + limits.time_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                stopped = "time"
    finally:
        if process.returncode is None:
            _kill_group(process)
            process.wait()
        for stream in (process.stdin, process.stdout, process.stderr):
            stream.close()
    report = root / "isolation"
    isolation = dict(line.partition("=")[::2] for line in report.read_text().splitlines()) if report.is_file() else {}
    report.unlink(missing_ok=True)
    if process.returncode == SETUP_FAILED and "error" not in isolation:
        isolation = {"error": f"the sandbox failed before running the code: {stderr.decode(errors='replace')}"}
    return SandboxResult(
        None if stopped else process.returncode,
        stdout.decode(errors="replace"),
        stderr.decode(errors="replace"),
        stopped == "time",
        time.monotonic() - started,
        isolation,
        stopped == "output",
    )


def _collect(process: subprocess.Popen, data: bytes, deadline: float, cap: int) -> tuple[bytes, bytes, str | None]:
    """Feed stdin and read stdout/stderr as they come until both close: (stdout, stderr, why it stopped early).

    Stops with "time" at `deadline` and with "output" once more than `cap` bytes came in all; holds at most
    `cap` bytes (the excess of the last read is dropped).
    """
    received = {process.stdout: bytearray(), process.stderr: bytearray()}
    total, sent = 0, 0
    with selectors.DefaultSelector() as selector:
        for stream in received:
            selector.register(stream, selectors.EVENT_READ)
        if data:
            os.set_blocking(process.stdin.fileno(), False)
            selector.register(process.stdin, selectors.EVENT_WRITE)
        else:
            process.stdin.close()
        while any(key.events == selectors.EVENT_READ for key in selector.get_map().values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(received[process.stdout]), bytes(received[process.stderr]), "time"
            for key, _ in selector.select(remaining):
                if key.fileobj is process.stdin:
                    sent += _feed(process.stdin, data[sent:])
                    if sent >= len(data):
                        selector.unregister(process.stdin)
                        process.stdin.close()
                    continue
                chunk = os.read(key.fd, READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                received[key.fileobj] += chunk[: max(0, cap - total)]
                total += len(chunk)
                if total > cap:
                    return bytes(received[process.stdout]), bytes(received[process.stderr]), "output"
    return bytes(received[process.stdout]), bytes(received[process.stderr]), None


def _feed(stdin: object, data: bytes) -> int:
    """Write what the pipe takes now; a process that closed its stdin takes nothing more (counted as all sent)."""
    try:
        return os.write(stdin.fileno(), data[:READ_CHUNK])  # type: ignore[attr-defined]
    except BrokenPipeError:
        return len(data)


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the sandbox's process group: the boot's waiter, and with it (PR_SET_PDEATHSIG) the confined PID 1
    and everything in its PID namespace."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended on its own meanwhile
        pass
