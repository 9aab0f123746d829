"""Drive `tandem ray` from tests: the launcher as a real subprocess (`launch.testing.RoleUnderTest`), the run
directory's metrics and counters."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.metrics import read_metrics
from common.sockets import Client, SocketSecurity
from common.types import StatsRequest
from launch.testing import RoleUnderTest, run_config

HERE = Path(__file__).resolve().parent
SIM_CONFIG = HERE / "ray_sim.toml"


class RayLaunch(RoleUnderTest):
    """`python -m launch.cli ray <run_dir>/config.json OVERRIDES...`, started at once: `config` with this run's root,
    name, Ray address and CurveZMQ keys (None: none). `close()` stops it (and its fleet) for sure."""

    def __init__(self, root: Path, name: str, address: str, keys: Path | None, config: Path, *overrides: str) -> None:
        security = {"curve_keys_dir": str(keys)} if keys else {}
        super().__init__(run_config(root, name, base=config, run=security, ray={"address": address}), "ray", *overrides)
        self.address = address
        self.start()

    def records(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        return read_metrics(path) if path.exists() else []

    def wait_steps(self, steps: int, timeout_s: float) -> list[dict[str, Any]]:
        """The learner's records once it has logged `steps` steps; fails with the launcher's output if not."""
        wait_for(
            lambda: len(self.records()) >= steps or self.poll() is not None,
            timeout_s,
            f"{steps} learner steps",
            self,
        )
        assert self.poll() is None or len(self.records()) >= steps, self.tail()
        return self.records()

    def wait_exit(self, timeout_s: float) -> int:
        return self.wait(timeout_s)

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def close(self) -> None:
        """SIGTERM the launcher (it stops the fleet in order), SIGKILL its group after a grace period."""
        self.stop(grace_s=60)


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str, launch: RayLaunch | None = None) -> Any:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}\n{launch.tail() if launch else ''}")


def control(action: str, run_name: str, *args: str, address: str | None = None) -> subprocess.CompletedProcess:
    """`tandem ray ACTION RUN ARGS [--address ADDRESS]` as a user types it, in a shell without RAY_ADDRESS."""
    argv = [sys.executable, "-m", "launch.cli", "ray", action, run_name, *args]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    return subprocess.run(
        argv + (["--address", address] if address else []),
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        check=False,
    )


def session_processes(session_id: int) -> list[str]:
    """Processes of the session `session_id` (a local Ray head leads one: Ray's GCS, raylet and workers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        if int(fields[3]) == session_id and fields[0] != "Z":
            found.append(f"{pid}: {stat[: stat.rfind(')') + 1]}")
    return found


def samples_per_s(records: list[dict[str, Any]], first_step: int, last_step: int) -> float:
    """Trained samples per second of wall time between the end of `first_step` and the end of `last_step`."""
    by_step = {r["step"]: r for r in records}
    start, end = by_step[first_step], by_step[last_step]
    samples = end["learner/samples_trained"] - start["learner/samples_trained"]
    return samples / (end["time"] - start["time"])


def member_pid(run_name: str, member: str) -> int:
    """The pid of a fleet member's role process ("generator-1", "learner-0"), from the controller's status (what
    `tandem ray status` shows); StopIteration if the fleet has no such member now."""
    from launch.ray.control import fleet_status

    status = fleet_status(run_name)
    members = [status["buffer"], *status["learners"], *status["generators"]]
    return next(m["pid"] for m in members if m is not None and m["name"] == member)


def buffer_counters(run_dir: Path) -> dict[str, Any]:
    """The buffer's last record (written as it stops), without the `buffer/` prefix."""
    final = read_metrics(run_dir / "buffer.jsonl")[-1]
    return {key.removeprefix("buffer/"): value for key, value in final.items()}


def processes_of(run_dir: Path) -> list[str]:
    """Processes whose command line names this run's directory (its roles), other than this one."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmdline and int(pid) != os.getpid():
            found.append(f"{pid}: {cmdline[:160]}")
    return found


def live_buffer_counters(address: str, keys: Path | None, timeout_s: float = 5.0) -> dict[str, int]:
    """The running buffer's counters, asked over its socket (StatsRequest)."""
    client = Client(address, SocketSecurity(curve_keys_dir=keys), identity="test-stats", role="monitor")
    try:
        reply, _ = client.request(StatsRequest(), timeout_s=timeout_s)
        return reply.counters
    finally:
        client.close()


def freeze_while_holding_leases(pid: int, address: str, keys: Path | None, heartbeat_timeout_s: float) -> None:
    """SIGSTOP generator `pid` until the buffer declares it lost with leases out (`generators_lost` rises: their
    prompts are re-issued), so that killing it afterwards is a crash mid-lease. A generator refused by admission
    control holds no lease at all for a while, and the buffer counts no loss then: thaw it (SIGCONT) and retry."""
    for _ in range(20):
        lost = live_buffer_counters(address, keys)["generators_lost"]
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 2 * heartbeat_timeout_s + 2  # silence, then the buffer's next tick
        while time.monotonic() < deadline:
            if live_buffer_counters(address, keys)["generators_lost"] > lost:
                return
            time.sleep(0.2)
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.5)
    raise AssertionError(f"generator pid {pid} held no lease in 20 tries")
