"""What the pipeline benchmarks share: launch one `tandem run`, watch its processes, and read what it wrote.

    outcome = launch_run(config_path, root, "sync-eta0", {"algo.max_staleness": 0}, timeout_s=600)
    rate = trained_rate(outcome.records, first_step=2)        # trained samples/s, steady state
    cpu_s = outcome.cpu_between("buffer", start_wall, end_wall)

A run is `python -m launch.cli run <run_dir>/config.json` as a subprocess (`launch.testing.RoleUnderTest`: the real
launcher and the real roles, never a re-implementation), its config CONFIG with the overrides on two free loopback
ports, its stdout/stderr in `<run_dir>/logs/run-0.out`.
While it runs, a `RunWatcher` thread samples, every `WATCH_S` seconds: the CPU time (user + system, from
/proc/<pid>/stat) of each role the launcher started, its process and its descendants (vLLM's engine core and
workers count for their generator; a descendant that exited keeps its last sample), when each learner step
appeared in metrics.jsonl, and when every generator had opened its metrics stream (its loop is about to start).
The wall clock of those samples is `time.time()`; `RunOutcome.step_wall` maps learner steps onto it.

Failure modes: a run that exits non-zero or outlives `timeout_s` raises `RunFailed` with the tail of its output
(the launcher's process group is killed first, so no role outlives the benchmark). Role processes are found by
their parent (the launcher) and their command line; a role that exits between two samples keeps its last sample.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.metrics import read_metrics
from launch.testing import RoleFailed, RoleUnderTest, run_config

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "examples" / "demo.toml"
WATCH_S = 0.1
DISCOVER_EVERY = 10  # passes between two searches for role processes and their descendants
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class RunFailed(RuntimeError):
    """`tandem run` exited non-zero or ran past its timeout; the message carries the tail of its output."""


@dataclass
class RunOutcome:
    """What one `tandem run` left behind, plus what the watcher saw while it ran (wall clock = time.time())."""

    name: str
    run_dir: Path
    wall_s: float
    records: list[dict[str, Any]]  # the learner's metrics.jsonl, one per step
    buffer_records: list[dict[str, Any]]  # buffer.jsonl (the last one is written as the buffer stops)
    step_wall: dict[int, float]  # learner step -> wall time its record was first seen (within WATCH_S)
    generators_ready_wall: float | None  # when every generator had opened its metrics stream
    cpu_samples: list[tuple[float, dict[str, float]]]  # (wall time, role name -> CPU seconds so far)
    load_avg: float  # the machine's 1-minute load average as the run ended (others' work competes for cores)
    started_wall: float = 0.0  # time.time() when the launcher was started: the origin of "seconds since launch"

    def cpu_at(self, role_prefix: str, wall: float) -> float:
        """CPU seconds used by the roles whose name starts with `role_prefix`, as of the last sample <= `wall`."""
        seen: dict[str, float] = {}
        for when, cpu in self.cpu_samples:
            if when > wall:
                break
            seen.update(cpu)
        return sum(value for role, value in seen.items() if role.startswith(role_prefix))

    def cpu_between(self, role_prefix: str, start_wall: float, end_wall: float) -> float:
        return self.cpu_at(role_prefix, end_wall) - self.cpu_at(role_prefix, start_wall)

    def published_s(self) -> dict[int, float]:
        """Learner step -> seconds from launch until its record appeared (when that version was published)."""
        return {step: wall - self.started_wall for step, wall in self.step_wall.items()}

    def first_step_after(self, wall: float) -> int:
        """The first learner step whose record appeared after `wall` (the last step if none did)."""
        later = [step for step, seen in sorted(self.step_wall.items()) if seen > wall]
        return later[0] if later else max(self.step_wall, default=0)


def every_core_overrides() -> dict[str, Any]:
    """Every core to every role (no pinning): simulated roles stand for separate machines and mostly sleep."""
    every_core = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    return {"generator.cpu_cores": every_core, "learner.cpu_cores": every_core}


def launch_run(config: Path, root: Path, name: str, overrides: dict[str, Any], timeout_s: float) -> RunOutcome:
    """Run `tandem run config` to completion under `root/name` with `overrides` (+ fresh ports); see the module
    docstring. Raises RunFailed on a non-zero exit or a timeout."""
    sections: dict[str, dict[str, Any]] = {}
    for dotted, value in overrides.items():
        section, key = dotted.split(".", 1)
        sections.setdefault(section, {})[key] = value
    launcher = RoleUnderTest(run_config(root, name, base=config, **sections), "run")
    started = time.time()
    with launcher:
        watcher = RunWatcher(launcher.pid, launcher.run_dir)
        watcher.start()
        try:
            code: int | None = launcher.wait(timeout_s)
        except RoleFailed:
            code = None
        finally:
            watcher.stop()
            launcher.stop(grace_s=60)  # the launcher stops its roles in order; what is left is killed
    if code != 0:
        why = f"ran past {timeout_s:.0f}s" if code is None else f"exited with {code}"
        tail = "\n".join(launcher.output().splitlines()[-40:])
        raise RunFailed(f"tandem run {name} {why}; output {launcher.output_path}:\n{tail}")
    run_dir = launcher.run_dir
    buffer_path = run_dir / "buffer.jsonl"
    return RunOutcome(
        name=name,
        run_dir=run_dir,
        wall_s=time.time() - started,
        records=read_metrics(run_dir / "metrics.jsonl"),
        buffer_records=read_metrics(buffer_path) if buffer_path.exists() else [],
        step_wall=watcher.step_wall,
        generators_ready_wall=watcher.generators_ready_wall,
        cpu_samples=watcher.cpu_samples,
        load_avg=os.getloadavg()[0],
        started_wall=started,
    )


PUBLISHED = "published.json"  # beside a run: {learner step: seconds from launch to its record}


def launch_fresh_run(config: Path, root: Path, name: str, overrides: dict[str, Any], timeout_s: float) -> RunOutcome:
    """`launch_run` under a name not used before (a run dir there would be resumed: SystemExit saying so), then
    <run_dir>/published.json: when each learner step's record appeared, in seconds since launch, so that the
    figures can be recomputed from the run directory alone (`--from-runs`)."""
    if (root / name).exists():
        raise SystemExit(f"{root / name} exists (a run there would resume it): remove it or pass --runs-dir")
    outcome = launch_run(config, root, name, overrides, timeout_s)
    (outcome.run_dir / PUBLISHED).write_text(json.dumps(outcome.published_s()))
    return outcome


class RunWatcher:
    """A daemon thread that samples a running `tandem run` (see the module docstring). Not restartable."""

    def __init__(self, launcher_pid: int, run_dir: Path) -> None:
        self.launcher_pid = launcher_pid
        self.run_dir = run_dir
        self.step_wall: dict[int, float] = {}
        self.generators_ready_wall: float | None = None
        self.cpu_samples: list[tuple[float, dict[str, float]]] = []
        self._metrics_offset = 0
        self._roles: dict[int, str] = {}  # pid -> role name, for the role processes and their descendants
        self._last_cpu: dict[int, float] = {}  # pid -> CPU seconds when last seen alive (kept after it exits)
        self._passes = 0
        self._expected_generators: int | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="run-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._done.wait(WATCH_S):
            now = time.time()
            if self._passes % DISCOVER_EVERY == 0:
                self._find_roles()
            self._passes += 1
            for pid in self._roles:
                seconds = process_cpu_s(pid)
                if seconds is not None:
                    self._last_cpu[pid] = seconds
            cpu: dict[str, float] = {}
            for pid, seconds in self._last_cpu.items():
                cpu[self._roles[pid]] = cpu.get(self._roles[pid], 0.0) + seconds
            if cpu:
                self.cpu_samples.append((now, cpu))
            self._read_new_steps(now)
            if self.generators_ready_wall is None and self._generators_ready():
                self.generators_ready_wall = now

    def _find_roles(self) -> None:
        """Role processes (children of the launcher) and their descendants (vLLM's engine and workers...)."""
        for pid in child_pids(self.launcher_pid):
            role = self._roles.get(pid) or role_name(pid)
            if role is None:
                continue
            self._roles[pid] = role
            for descendant in descendant_pids(pid):
                self._roles.setdefault(descendant, role)

    def _read_new_steps(self, now: float) -> None:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return
        with path.open() as handle:
            handle.seek(self._metrics_offset)
            for line in handle:
                if not line.endswith("\n"):
                    break  # being written: read it next time
                self._metrics_offset += len(line.encode())
                self.step_wall.setdefault(int(json.loads(line)["step"]), now)

    def _generators_ready(self) -> bool:
        if self._expected_generators is None:
            config_path = self.run_dir / "config.json"  # written by the launcher before it starts any role
            if not config_path.exists():
                return False
            self._expected_generators = json.loads(config_path.read_text())["generator"]["count"]
        expected = self._expected_generators
        return all((self.run_dir / f"generator-{i}.jsonl").exists() for i in range(expected))


def child_pids(parent: int) -> list[int]:
    """Live children of `parent`, whichever of its threads started them (/proc/<pid>/task/*/children)."""
    children: list[int] = []
    for children_file in Path(f"/proc/{parent}/task").glob("*/children"):
        try:
            children += [int(pid) for pid in children_file.read_text().split()]
        except OSError:  # the thread or the process is gone
            continue
    return children


def descendant_pids(root: int) -> list[int]:
    """Live children, grandchildren, ... of `root`."""
    found, frontier = [], [root]
    while frontier:
        children = child_pids(frontier.pop())
        found += children
        frontier += children
    return found


def role_name(pid: int) -> str | None:
    """ "buffer-0", "learner-0" or "generator-<i>" from a role's command line (`launch.cli ROLE ...`); None if the
    process is not a role (or is gone)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if "launch.cli" not in argv or argv.index("launch.cli") + 1 >= len(argv):
        return None
    role = argv[argv.index("launch.cli") + 1]
    if role == "generator" and "--generator.index" in argv:
        return f"generator-{argv[argv.index('--generator.index') + 1]}"
    return f"{role}-0" if role in ("buffer", "learner") else None


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a live process (its own threads, not its children); None if it is gone."""
    stat = _read_stat(pid)
    return None if stat is None else (int(stat[11]) + int(stat[12])) / CLOCK_TICKS


def _read_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name: state [0], ppid [1], utime [11], stime [12]."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def kept_runs(
    saved_path: Path, new: list[dict[str, Any]], key: tuple[str, ...], same: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """The runs of the result saved at `saved_path` that `new` does not redo (equal values of every field in `key`)
    and that agree with `new` on every field in `same` (say, the steps each run trained), so that a grid run a piece
    at a time (a real run takes 15-20 minutes on 2 cores) adds to the saved figures instead of replacing them. A
    saved run lacking a `key` field (a former version of the benchmark wrote it) is left out. Each kept run keeps
    the `cpu` it was measured on (`benchmarks.common.cpu`; a run saved before runs recorded it has none)."""
    if not saved_path.exists():
        return []
    redone = {tuple(run[field] for field in key) for run in new}
    wanted = {field: {run[field] for run in new} for field in same}
    kept = [
        run
        for run in json.loads(saved_path.read_text()).get("runs", [])
        if all(field in run for field in key)
        and tuple(run[field] for field in key) not in redone
        and all(run.get(field) in values for field, values in wanted.items())
    ]
    if kept:
        print(f"kept {len(kept)} saved runs from {saved_path.name} (--fresh leaves them out)")
    return kept


def trained_rate(records: list[dict[str, Any]], first_step: int, last_step: int | None = None) -> dict[str, float]:
    """Trained samples/s from the record of `first_step` to that of `last_step` (default: the last record), on the
    learner's clock; with the window's steps, samples and seconds. Raises ValueError when the run has no step
    after `first_step`."""
    by_step = {int(r["step"]): r for r in records}
    last = max(by_step, default=0) if last_step is None else last_step
    if first_step not in by_step or last not in by_step or last <= first_step:
        raise ValueError(
            f"need learner steps after step {first_step} (the run has {len(records)} records): "
            "raise the run's total_steps"
        )
    start, end = by_step[first_step], by_step[last]
    seconds = end["time"] - start["time"]
    samples = end["learner/samples_trained"] - start["learner/samples_trained"]
    return {
        "samples_per_s": samples / seconds,
        "window_samples": samples,
        "window_s": seconds,
        "window_steps": last - first_step,
        "step_s": seconds / (last - first_step),
    }


def mean_of(records: list[dict[str, Any]], key: str, first_step: int = 0) -> float:
    """Mean of a numeric metric over the records after `first_step` (NaN if none has it)."""
    values = [r[key] for r in records if r["step"] > first_step and isinstance(r.get(key), (int, float))]
    return sum(values) / len(values) if values else float("nan")


def cpu_use(outcome: RunOutcome, first_step: int) -> dict[str, float]:
    """From `first_step` to the last step: cores used by the learner and by the generator(s) (with vLLM's
    processes), and the learner's CPU seconds per second of `train_step`: about 1 when it had its core to
    itself, less when other processes on the machine took part of it (its training time then says more about
    them than about Tandem)."""
    last = max(outcome.step_wall)
    start, end = outcome.step_wall[first_step], outcome.step_wall[last]
    train_s = sum(r["perf/train_s"] for r in outcome.records if first_step < r["step"] <= last)
    learner = outcome.cpu_between("learner", start, end)
    return {
        "learner_cores": learner / (end - start),
        "generator_cores": outcome.cpu_between("generator", start, end) / (end - start),
        "learner_cpu_per_train_s": learner / max(train_s, 1e-9),
    }
