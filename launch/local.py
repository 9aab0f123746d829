"""`tandem run CONFIG`: every role on this machine, each its own process, supervised.

    tandem run demo --run.name my-run              # a packaged config by name, or a TOML file

Order: buffer, then the learner rank(s) (whose publisher serves the initial weights), then the reward service
(`reward-0`, when env.reward_model is scored out of process: `config.reward_service`), then the generator(s).
Each child runs `python -m launch.cli ROLE <run_dir>/config.json ...` in its own session (so that vLLM's and
torchrun's own children go with it), pinned to its CPU cores (`plan_cores`: run.placement "split" halves the machine
between generators and learner, "colocated" gives each every core, docs/placement.md), with stdout/stderr in
`logs/<role>-<i>.out`. On a machine with GPUs each role sees only its own (CUDA_VISIBLE_DEVICES,
launch/gpu_plan.py): the learner's first, then each generator's, then the reward service's; too few is refused
before anything starts (exit 2) unless run.share_gpus.

Ends when:
  - the learner exits 0           -> the run is over: the buffer and the generators exit by themselves (the learner's
                                     final report ends them); any still running get SIGTERM, exit 0;
  - any role exits non-zero       -> the others are stopped, its last meaningful log line (a traceback's
                                     `SomeError: message`) and the path of its log are printed, exit 1 (so does
                                     the reward service exiting at all: it only stops when told);
  - Ctrl-C / SIGTERM to launcher  -> everything is stopped (the learner saves a checkpoint after its step in flight),
                                     the command that resumes the run is printed, exit 130.
Stopping SIGTERMs the generators and the learner at once, then the buffer and the reward service (generators
return their leases to a live buffer, and their last groups are scored); each gets its grace (`stop_grace_s`: a
generator's drain timeout, the learner's stop timeout, plus STOP_MARGIN_S) before its process group is SIGKILLed.
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.config import TandemConfig, parse_cores, write_resolved
from common.logs import setup_logging
from common.run_dir import reuse_problem
from common.signals import caught_signals
from common.weights import weights_store_dirs
from launch.gpu_plan import GpuPlan, gpu_problem, plan_gpus, visible_gpus
from launch.progress import RunProgress, summarize
from learners.checkpoint import latest_step

STOP_MARGIN_S = 15.0  # beyond a role's own bound: signal handling, closing sockets, an engine's shutdown
STOP_STAGES = (("generator", "learner"), ("buffer", "reward"))  # generators drain into a live buffer and RM
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


def resumed_from(config: TandemConfig) -> int:
    """The step this session starts after: with learner.resume, the latest complete checkpoint's (0 if none),
    else 0. The end summary counts this session's steps from there and the whole run's separately."""
    return (latest_step(config.run.run_dir / "checkpoints") or 0) if config.learner.resume else 0


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


def stop_grace_s(config: TandemConfig, role: str) -> float:
    """How long a role ("generator", "learner", "buffer") may take to stop after SIGTERM before it is killed: a
    generator drains for up to generator.drain_timeout_s, a learner finishes its step and checkpoints within
    learner.stop_timeout_s; each plus STOP_MARGIN_S. The buffer only flushes its journal and metrics."""
    own = {"generator": config.generator.drain_timeout_s, "learner": config.learner.stop_timeout_s}
    return own.get(role, 0.0) + STOP_MARGIN_S


def plan_cores(config: TandemConfig) -> tuple[set[int] | None, set[int] | None]:
    """(generator cores, learner cores): split this machine's cores so that the two never fight, or, with
    run.placement = "colocated" (synchronous training only: the config refuses it at η > 0), give each every core.

    Explicit `generator.cpu_cores` / `learner.cpu_cores` win. Otherwise, "split": the generators get the first half
    (at least one core) and the learner the rest; on one core both share it. "colocated": each role not written
    gets every core this process may use (`os.sched_getaffinity(0)`), so that the role pins them all and sizes its
    thread pool to them (vLLM's VLLM_CPU_OMP_THREADS_BIND, torch's set_num_threads), as an explicit list would.
    """
    available = sorted(os.sched_getaffinity(0))
    explicit = (
        parse_cores(config.generator.cpu_cores, "generator.cpu_cores") or None,
        parse_cores(config.learner.cpu_cores, "learner.cpu_cores") or None,
    )
    if config.run.placement == "colocated":
        generator, learner = explicit
        return generator or set(available), learner or set(available)
    if any(explicit) or len(available) < 2:
        return explicit
    half = max(1, len(available) // 2)
    return set(available[:half]), set(available[half:])


def plan_reward_cores(
    config: TandemConfig, generator_cores: set[int] | None
) -> tuple[set[int] | None, set[int] | None]:
    """(reward service cores, generator cores): the reward service's own core where there is one to spare.

    An explicit `reward.cpu_cores` wins. Colocated (run.placement): every core, as the other roles. Else, when the
    generators' share (plan_cores's, not written by the user) holds 2 or more cores, its last one goes to the reward
    service. Else it shares the generators' cores (2 cores here: the reward model scores a group while the
    generator waits for it and samples the next ones)."""
    explicit = parse_cores(config.reward.cpu_cores, "reward.cpu_cores")
    if explicit:
        return explicit, generator_cores
    if config.run.placement == "colocated":
        return set(os.sched_getaffinity(0)), generator_cores
    if generator_cores and len(generator_cores) >= 2 and not config.generator.cpu_cores:
        last = max(generator_cores)
        return {last}, generator_cores - {last}
    return generator_cores, generator_cores


def spin_warning(placement: str, environ: Mapping[str, str]) -> str | None:
    """Why colocated roles would burn the cores they share while idle, or None: an OMP_WAIT_POLICY = ACTIVE (or a
    GOMP_SPINCOUNT) the roles inherit keeps each idle role's OpenMP threads spinning for the other's whole phase.

    libgomp's default (neither set) spins a few hundred thousand iterations, then sleeps: an idle colocated
    role measured 0.03-0.04 cores (benchmarks/colocated_idle.py), which is why the launcher sets no policy of its
    own (PASSIVE would put the working role's threads to sleep at every parallel region too)."""
    policy, spincount = environ.get("OMP_WAIT_POLICY", ""), environ.get("GOMP_SPINCOUNT", "")
    if placement != "colocated" or (policy.strip().lower() != "active" and not spincount):
        return None
    written = [
        f"{name}={value}" for name, value in (("OMP_WAIT_POLICY", policy), ("GOMP_SPINCOUNT", spincount)) if value
    ]
    return (
        f"run.placement colocated with {' and '.join(written)} in the environment: each idle role's OpenMP threads "
        "spin on the cores the working role needs (an idle torch process measured ~1 core with ACTIVE, ~0 without): "
        f"unset {'them' if len(written) > 1 else 'it'}"
    )


def describe_cores(roles: list[Role]) -> str:
    """`learner-0 cores 0,1; generator-0 cores 0,1` (roles not pinned left out; "no role pinned" if none is)."""
    pinned = [f"{role.name} cores {cores_spec(role.cores)}" for role in roles if role.cores]
    return "; ".join(pinned) or "no role pinned"


def cores_spec(cores: set[int] | None) -> str:
    return ",".join(map(str, sorted(cores))) if cores else ""


def string_override(value: str) -> str:
    """An override value that parses back as exactly this string (a bare `1` would parse as the integer 1)."""
    return json.dumps(value)


def build_roles(config: TandemConfig, config_path: Path, gpus: GpuPlan | None = None) -> list[Role]:
    """The roles in start order (the module docstring), each with its cores and, with a GPU plan, its GPUs."""
    generator_cores, learner_cores = plan_cores(config)
    if config.reward_service:
        reward_cores, generator_cores = plan_reward_cores(config, generator_cores)
    base = [sys.executable, "-m", "launch.cli"]
    roles = [Role("buffer-0", [*base, "buffer", str(config_path)], None)]
    roles.append(
        Role(
            "learner-0",
            [*base, "learner", str(config_path), "--learner.cpu_cores", string_override(cores_spec(learner_cores))],
            learner_cores,
        )
    )
    if config.reward_service:
        reward_argv = [
            *base,
            "reward",
            str(config_path),
            "--reward.cpu_cores",
            string_override(cores_spec(reward_cores)),
        ]
        roles.append(Role("reward-0", reward_argv, reward_cores))
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
    if gpus is not None:
        for role in roles:
            role.env.update(gpus.env(role.name))
    return roles


def nodes_refused(config: TandemConfig, launcher: str) -> str | None:
    """learner.nnodes > 1 is for ranks started by hand on each host: a launcher that places the learner refuses it."""
    if config.learner.nnodes == 1:
        return None
    return (
        f"learner.nnodes = {config.learner.nnodes}: {launcher}; leave learner.nnodes out, or start `tandem learner "
        "CONFIG --learner.node_rank R` on each host (docs/clusters.md)"
    )


def run(config: TandemConfig) -> int:
    """Start every role, supervise them, stop them (see the module docstring); returns the exit code (2: the run
    directory holds another run, refused before anything starts: `common.run_dir`)."""
    run_dir = config.run.run_dir
    gpus = [] if config.run.simulate else visible_gpus()
    refused = (
        nodes_refused(config, "tandem run starts every role on this machine")
        or reuse_problem(run_dir, config.learner.resume, whole_run=True)
        or gpu_problem(config, gpus)
    )
    if refused:
        print(f"tandem run: {refused}", file=sys.stderr)
        return 2
    config_path = write_resolved(config, run_dir)
    log = setup_logging("launcher", 0, run_dir, simulation=config.run.simulate)
    plan = plan_gpus(config, gpus)
    roles = build_roles(config, config_path, plan)
    log.info("run directory %s; starting %s", run_dir, ", ".join(role.name for role in roles))
    if plan is not None:
        log.info("GPUs (CUDA_VISIBLE_DEVICES): %s; the others none", plan.describe())
    if plan is not None and plan.shared:
        log.warning(
            "run.share_gpus: %d GPU(s) shared by roles that need more; each vLLM engine takes "
            "generator.gpu_memory_utilization = %g of its GPU",
            len(gpus),
            config.generator.gpu_memory_utilization,
        )
    mode = "SIMULATION (no vLLM, no DeepSpeed: compute stand-ins)" if config.run.simulate else "real engines"
    log.info("mode: %s; eta = %d; %d generator(s)", mode, config.algo.max_staleness, config.generator.count)
    log.info("placement %s: %s", config.run.placement, describe_cores(roles))
    spinning = spin_warning(config.run.placement, os.environ)
    if spinning:
        log.warning("%s", spinning)
    start = time.time()
    first_step = resumed_from(config)
    if config.learner.resume and first_step == 0:
        log.warning("learner.resume = true, but %s holds no checkpoint: the run starts at step 0", run_dir)
    progress = RunProgress(run_dir / "metrics.jsonl", config.learner.total_steps)
    failed: Role | None = None
    with caught_signals() as interrupted:
        try:
            for role in roles:
                role.start(run_dir)
            with progress:
                failed = supervise(roles, progress, interrupted, stop_grace_s(config, "learner"))
        finally:
            stop_all(roles, log, config)
            for store in weights_store_dirs(run_dir):  # host copies a killed generator left, wherever they lie
                shutil.rmtree(store, ignore_errors=True)
    if interrupted:
        log.warning("interrupted; every role stopped")
        print(interrupt_message(config, config_path), file=sys.stderr)
        return 130
    if failed is not None:
        print(f"\n{failed.failure()}", file=sys.stderr)
        return 1
    print(summarize(run_dir, wall_s=time.time() - start, first_step=first_step))
    return 0


def interrupt_message(config: TandemConfig, config_path: Path) -> str:
    """What an interrupted run left and the exact command that continues it (the resolved config of the run)."""
    step = latest_step(config.run.run_dir / "checkpoints")
    command = f"tandem run {config_path} --learner.resume true"
    if step is None:
        return (
            f"\ninterrupted before any checkpoint: `{command}` would start again at step 0 (or run it anew with "
            "another --run.name)"
        )
    return (
        f"\ninterrupted: checkpoint of step {step}/{config.learner.total_steps} in {config.run.run_dir / 'checkpoints'}"
        f"\n  resume with: {command}"
    )


def supervise(roles: list[Role], progress: RunProgress, interrupted: list[int], learner_grace_s: float) -> Role | None:
    """Wait until the learner finishes (None) or some role fails (that role); refresh the progress display.

    A generator that exits 0 finished its work (out of prompts, or the run is over); so did a buffer that exits 0
    (the learner's final report came: it is saving its last checkpoint). A learner still running `learner_grace_s`
    after the buffer exited is waiting for a buffer that is gone: the buffer is then the failed role. The reward
    service never ends by itself: its exit, whatever the code, fails the run."""
    learner = next(role for role in roles if role.name.startswith("learner"))
    buffer_gone_at: float | None = None
    while not interrupted:
        progress.refresh()
        for role in roles:
            code = role.poll()
            if code is None:
                continue
            if role is learner and code == 0:
                return None
            if role.name.startswith("reward"):
                return role
            if role.name.startswith("buffer") and code == 0:
                buffer_gone_at = buffer_gone_at or time.monotonic()
                if time.monotonic() - buffer_gone_at < learner_grace_s:
                    continue
            elif role is not learner and code == 0:
                continue  # a generator that ran out of prompts, or heard that the run is over
            return role
        time.sleep(0.5)
    return None


def stop_all(roles: list[Role], log, config: TandemConfig) -> None:
    """Stop in stages (STOP_STAGES): the generators and the learner at once (generators drain and return their
    leases, the learner finishes its step and checkpoints), then the buffer.

    Every role gets SIGTERM and its grace (`stop_grace_s`); then its whole process group gets SIGKILL, which also
    reaches grandchildren (vLLM's engine process, torchrun's ranks) whose parent already exited.
    """
    for stage in STOP_STAGES:
        members = [role for role in roles if role.name.startswith(stage)]
        for role in members:
            role.signal(signal.SIGTERM)
        started = time.time()
        for role in members:
            grace = stop_grace_s(config, role.name.split("-")[0])
            if role.wait(started + grace) is None:
                log.warning("%s did not stop within %.0fs: killing it", role.name, grace)
            role.kill_group()
