"""Run untrusted Python (a model's code and the tests that judge it) in a sandboxed subprocess.

    result = run_python("print(sum(range(10)))", files={"solution.py": code}, limits=SandboxLimits(time_s=5))
    result.returncode, result.stdout, result.stderr, result.timed_out, result.isolation

What confines the process (`actors/sandbox_boot.py` sets it up before the first untrusted line runs):
  * a fresh temporary directory: its working directory and HOME, the only place it may write; deleted afterwards;
  * no inherited environment (PATH, HOME and LANG only: no secrets, no PYTHONPATH) and `python -I -S` (isolated
    mode, no site-packages: the standard library only);
  * limits: wall-clock `time_s` (then its whole process group is killed), CPU seconds, address space
    (`memory_mb`, RLIMIT_AS: an allocation beyond it raises MemoryError), file size, open files, no core dumps;
  * network: a new, empty network namespace when the kernel allows it (`isolation["network"] == "netns"`), and in
    every case an audit hook that refuses to create sockets (`"audit_hook"` when it is the only layer);
  * filesystem: a private mount namespace with `/` read-only and only the temporary directory writable, when the
    kernel allows it (`isolation["filesystem"] == "readonly_root"`), and in every case the audit hook refusing
    writes, renames, removals and permission changes outside the temporary directory;
  * the audit hook also refuses subprocesses, exec, fork and ctypes.
The kernel layers need CAP_SYS_ADMIN (root) or unprivileged user namespaces; where neither is available the audit
hook alone remains, which stops ordinary code but not code that tampers with the interpreter's internals: run such
generators in a container without network. The sandboxed process keeps the caller's user id.

Thread-safe (no preexec_fn): environment steps may call `run_python` from many threads at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

BOOT = Path(__file__).with_name("sandbox_boot.py")
OUTPUT_LIMIT = 64 * 1024  # characters of stdout/stderr kept


@dataclass(frozen=True)
class SandboxLimits:
    time_s: float = 5.0  # wall clock
    memory_mb: int = 512  # address space
    file_size_mb: int = 16  # largest file it may write
    max_open_files: int = 64


@dataclass(frozen=True)
class SandboxResult:
    returncode: int | None  # None when killed at the time limit
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    isolation: dict[str, str] = field(default_factory=dict)  # what the kernel granted (see the module docstring)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def run_python(
    source: str, files: dict[str, str] | None = None, limits: SandboxLimits = SandboxLimits(), stdin: str = ""
) -> SandboxResult:
    """Run `source` as `__main__` in the sandbox, with `files` (name -> text) written beside it first.

    Never raises for what the code does (errors, timeouts, limits show in the result); raises ValueError for a file
    name that leaves the directory, OSError if the interpreter cannot be started at all.
    """
    with tempfile.TemporaryDirectory(prefix="tandem-sandbox-") as directory:
        root = Path(directory).resolve()
        for name, text in {**(files or {}), "main.py": source}.items():
            target = (root / name).resolve()
            if root not in target.parents:
                raise ValueError(f"sandbox file name {name!r} must stay inside the sandbox directory")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        command = [sys.executable, "-I", "-S", str(BOOT), str(root), str(root / "main.py"), json.dumps(asdict(limits))]
        environment = {"PATH": "/usr/bin:/bin", "HOME": str(root), "LANG": "C.UTF-8"}
        started = time.monotonic()
        process = subprocess.Popen(
            command,
            cwd=root,
            env=environment,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        timed_out = False
        try:
            stdout, stderr = process.communicate(stdin, timeout=limits.time_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(process)
            stdout, stderr = process.communicate()
        seconds = time.monotonic() - started
        isolation_file = root / ".isolation.json"
        isolation = json.loads(isolation_file.read_text()) if isolation_file.is_file() else {}
    return SandboxResult(
        None if timed_out else process.returncode,
        stdout[-OUTPUT_LIMIT:],
        stderr[-OUTPUT_LIMIT:],
        timed_out,
        seconds,
        isolation,
    )


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the sandbox's whole process group (it leads a session of its own)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended on its own meanwhile
        pass
