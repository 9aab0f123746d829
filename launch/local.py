"""`tandem run CONFIG`: every role on this machine, each its own process, supervised.

    tandem run demo --run.name my-run              # a packaged config by name, or a TOML file

Order: buffer, then the learner rank(s) (whose publisher serves the initial weights), then the generator(s).
Each child runs `python -m launch.cli ROLE <run_dir>/config.json ...` in its own session (so that vLLM's and
torchrun's own children go with it), pinned to its CPU cores, with stdout/stderr in `logs/<role>-<i>.out`.

Ends when:
  - the learner exits 0           -> generators and buffer get SIGTERM (then SIGKILL after a grace period), exit 0;
  - any role exits non-zero       -> the others are stopped, its last meaningful log line (a traceback's
                                     `SomeError: message`) and the path of its log are printed, exit 1;
  - Ctrl-C / SIGTERM to launcher  -> everything is stopped, exit 130.
No child outlives the launcher.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.config import TandemConfig, parse_cores, write_resolved
from common.logs import setup_logging
from common.weights import weights_store_dir
from launch.progress import RunProgress, summarize

GRACE_S = 20.0
STOP_ORDER = ("generator", "learner", "buffer")  # generators return their leases to a live buffer
PR_SET_PDEATHSIG = 1  # linux/prctl.h


# torch.distributed rendezvous variables: a role must not inherit them from whatever started the launcher (a
# torchrun-managed process, or a test process that initialised its own group), or its learner would join that group.
RENDEZVOUS_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


def role_environment() -> dict[str, str]:
    """This process's environment without the torch.distributed rendezvous variables."""
    return {key: value for key, value in os.environ.items() if key not in RENDEZVOUS_VARIABLES}


@dataclass
class Role:
    """One supervised child process."""

    name: str  # "buffer-0", "generator-1", "learner-0"
    argv: list[str]
    cores: set[int] | None
    process: subprocess.Popen | None = None
    out_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    stop_with_parent: bool = False  # SIGTERM the role when the thread that started it dies (Linux; `tandem ray`)

    def start(self, run_dir: Path) -> None:
        self.out_path = run_dir / "logs" / f"{self.name}.out"
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        out = self.out_path.open("ab")
        self.process = subprocess.Popen(
            self.argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopping it stops vLLM's / torchrun's children too
            env={**role_environment(), **self.env},
            preexec_fn=_child_setup(self.cores, self.stop_with_parent),  # noqa: PLW1509 - only sched_setaffinity and prctl run there, no locks taken
        )
        out.close()

    def wait(self, deadline: float) -> int | None:
        """Wait for the role to exit until `deadline` (time.time()); its exit code, or None if still running."""
        while self.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        return self.poll()

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        """SIGKILL the role's whole process group (even if its leader has exited) and reap the leader."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()

    def tail(self, lines: int = 30) -> str:
        log_file = self.out_path
        if log_file is None or not log_file.exists():
            return "(no output)"
        return "\n".join(log_file.read_text(errors="replace").splitlines()[-lines:])

    def failure(self) -> str:
        """Why the role failed, in two lines: its exit code and the last meaningful line of its log (see
        last_meaningful_line), then where the full log is."""
        text = self.out_path.read_text(errors="replace") if self.out_path and self.out_path.exists() else ""
        return f"{self.name} exited with code {self.poll()}: {last_meaningful_line(text)}\n  full log: {self.out_path}"


TRACEBACK = "Traceback (most recent call last):"


def last_meaningful_line(text: str) -> str:
    """The line of a role's output that says why it failed: the exception line (`SomeError: message`) of the last
    Python traceback in it, else its last non-empty line; "(no output)" when there is none.

    A traceback may carry a prefix on every line (vLLM's `(EngineCore_DP0 pid=7) `, torch's `[rank0]: `): its
    exception line is the first after the `Traceback (most recent call last):` header that, without that prefix,
    is not indented (the frames and their source lines are). A chained exception prints its cause first, so the
    last header is the one of the exception that ended the role."""
    lines = [line.rstrip() for line in text.splitlines()]
    headers = [i for i, line in enumerate(lines) if line.endswith(TRACEBACK)]
    if headers:
        prefix = lines[headers[-1]].removesuffix(TRACEBACK)
        for line in lines[headers[-1] + 1 :]:
            body = line.removeprefix(prefix) if line.startswith(prefix) else line
            if body and not body[0].isspace():
                return body
    meaningful = [line.strip() for line in lines if line.strip()]
    return meaningful[-1] if meaningful else "(no output)"


def _child_setup(cores: set[int] | None, stop_with_parent: bool) -> Callable[[], None] | None:
    """What the child runs between fork and exec: pin its cores; ask the kernel for SIGTERM when the parent
    thread dies (PR_SET_PDEATHSIG), so that a role never outlives a supervisor that was killed."""
    if not cores and not stop_with_parent:
        return None
    libc = ctypes.CDLL(None, use_errno=True) if stop_with_parent else None

    def setup() -> None:
        if cores:
            os.sched_setaffinity(0, cores)
        if libc is not None:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return setup


def plan_cores(config: TandemConfig) -> tuple[set[int] | None, set[int] | None]:
    """(generator cores, learner cores): split this machine's cores so that the two never fight.

    Explicit `generator.cpu_cores` / `learner.cpu_cores` win. Otherwise the generators get the first half
    (at least one core) and the learner the rest; on one core both share it.
    """
    available = sorted(os.sched_getaffinity(0))
    explicit = (
        parse_cores(config.generator.cpu_cores, "generator.cpu_cores") or None,
        parse_cores(config.learner.cpu_cores, "learner.cpu_cores") or None,
    )
    if any(explicit) or len(available) < 2:
        return explicit
    half = max(1, len(available) // 2)
    return set(available[:half]), set(available[half:])


def cores_spec(cores: set[int] | None) -> str:
    return ",".join(map(str, sorted(cores))) if cores else ""


def string_override(value: str) -> str:
    """An override value that parses back as exactly this string (a bare `1` would parse as the integer 1)."""
    return json.dumps(value)


def build_roles(config: TandemConfig, config_path: Path) -> list[Role]:
    generator_cores, learner_cores = plan_cores(config)
    base = [sys.executable, "-m", "launch.cli"]
    roles = [Role("buffer-0", [*base, "buffer", str(config_path)], None)]
    roles.append(
        Role(
            "learner-0",
            [*base, "learner", str(config_path), "--learner.cpu_cores", string_override(cores_spec(learner_cores))],
            learner_cores,
        )
    )
    for index in range(config.generator.count):
        roles.append(
            Role(
                f"generator-{index}",
                [
                    *base,
                    "generator",
                    str(config_path),
                    "--generator.index",
                    str(index),
                    "--generator.cpu_cores",
                    string_override(cores_spec(generator_cores)),
                ],
                generator_cores,
            )
        )
    return roles


def run(config: TandemConfig) -> int:
    run_dir = config.run.run_dir
    config_path = write_resolved(config, run_dir)
    log = setup_logging("launcher", 0, run_dir, simulation=config.run.simulate)
    roles = build_roles(config, config_path)
    log.info("run directory %s; starting %s", run_dir, ", ".join(role.name for role in roles))
    mode = "SIMULATION (no vLLM, no DeepSpeed: compute stand-ins)" if config.run.simulate else "real engines"
    log.info("mode: %s; eta = %d; %d generator(s)", mode, config.algo.max_staleness, config.generator.count)
    start = time.time()
    interrupted: list[int] = []
    previous = {sig: signal.signal(sig, lambda s, _f: interrupted.append(s)) for sig in (signal.SIGINT, signal.SIGTERM)}
    progress = RunProgress(run_dir / "metrics.jsonl", config.learner.total_steps)
    failed: Role | None = None
    try:
        for role in roles:
            role.start(run_dir)
        with progress:
            failed = supervise(roles, progress, interrupted)
    finally:
        stop_all(roles, log)
        shutil.rmtree(weights_store_dir(run_dir), ignore_errors=True)  # host copies a killed generator left
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if interrupted:
        log.warning("interrupted; every role stopped")
        return 130
    if failed is not None:
        print(f"\n{failed.failure()}", file=sys.stderr)
        return 1
    print(summarize(run_dir, wall_s=time.time() - start))
    return 0


def supervise(roles: list[Role], progress: RunProgress, interrupted: list[int]) -> Role | None:
    """Wait until the learner finishes (None) or some role fails (that role); refresh the progress display."""
    learner = next(role for role in roles if role.name.startswith("learner"))
    while not interrupted:
        progress.refresh()
        for role in roles:
            code = role.poll()
            if code is None:
                continue
            if role is learner and code == 0:
                return None
            if role is not learner and code == 0 and role.name.startswith("generator"):
                continue  # a generator that ran out of prompts finished its work
            return role
        time.sleep(0.5)
    return None


def stop_all(roles: list[Role], log) -> None:
    """Stop in order: generators (they return leases to a live buffer), learners, then the buffer.

    Each stage gets SIGTERM and a grace period; then its whole process group gets SIGKILL, which also reaches
    grandchildren (vLLM's engine process, torchrun's ranks) whose parent already exited.
    """
    for stage in STOP_ORDER:
        members = [role for role in roles if role.name.startswith(stage)]
        for role in members:
            role.signal(signal.SIGTERM)
        deadline = time.time() + GRACE_S
        for role in members:
            if role.wait(deadline) is None:
                log.warning("%s did not stop within %.0fs: killing it", role.name, GRACE_S)
            role.kill_group()
