"""The local Ray cluster that `tandem ray CONFIG` starts when no cluster is named (no `ray.address`, no
RAY_ADDRESS): a head process of its own, in its own session, so that the cluster and the run outlive the driver.

    cluster = start_local(config)          # `python -m launch.ray.local ...` is up; cluster.address is its GCS
    ray.init(address=cluster.address)      # the driver joins it as it would join any cluster
    cluster.shut_down(outcome)             # the outcome recorded; the head stops, and every Ray process with it

    found = LocalCluster.load("my-run")    # from any shell of this machine (`tandem ray status|stop my-run`)
    found.running, found.address, found.over_line()

The head starts Ray with `ray.init(address="local")`, so Ray's GCS, raylet and workers are its children and end
with it, and writes the cluster's address into the run's record, `<tmp>/tandem-ray-<uid>/<run>.json` (one record
per run name on this machine; it stays after the run, with the outcome, so that `tandem ray status RUN` can say how
the run ended). The head keeps the cluster until
  - SIGTERM or SIGINT: from the driver at the run's end, or from `tandem ray stop RUN`;
  - its driver is gone (SIGKILLed) and the run's controller has been gone for GONE_S (removed by `tandem ray stop
    RUN`, or never created);
  - its driver is gone and the run has been over for LINGER_S with nobody following it: the head then records the
    outcome and removes the controller (the roles were stopped when the run ended).
A Ctrl-C in the driver's terminal does not reach the head (its own session): the driver stops the fleet, then it.

Failure modes: a head that is not up within START_TIMEOUT_S is killed, and RuntimeError quotes its output
(`<run_dir>/logs/ray-head-0.out`). A record whose head is gone without an outcome (head SIGKILLed, machine
rebooted) reads as a run that is over, its outcome unknown.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

RECORDS = Path(tempfile.gettempdir()) / f"tandem-ray-{os.getuid()}"  # one JSON record per run name
HEAD_MODULE = "launch.ray.local"
START_TIMEOUT_S = 120.0  # Ray's head up (GCS, raylet, dashboard) on a loaded machine
POLL_S = 1.0  # how often the head looks at its driver (and, once the driver is gone, at the controller)
GONE_S = 10.0  # controller absent this long after the driver died: the run was stopped (or never started)
LINGER_S = 60.0  # a run over with nobody following it keeps its cluster this long (`tandem ray status` sees it)
DRIVER_END_S = 60.0  # `tandem ray stop` waits this long for a live driver to shut the cluster down itself
HEAD_STOP_S = 30.0  # SIGTERM to the head -> every Ray process gone; then its process group is SIGKILLed
CALL_S = 10.0  # one call to the controller from the head
AUTH_MODE = "RAY_AUTH_MODE"  # Ray's switch of token authentication


@dataclass
class LocalCluster:
    """The record of one run's local cluster (see the module docstring). `outcome` is {"outcome", "code"}."""

    run: str
    run_dir: str
    driver_pid: int
    head_pid: int
    address: str
    auth_mode: str = ""  # RAY_AUTH_MODE as the head has it ("token": Ray's default for a new local cluster)
    outcome: dict[str, Any] | None = None

    @staticmethod
    def path(run_name: str) -> Path:
        return RECORDS / f"{quote(run_name, safe='')}.json"

    @classmethod
    def load(cls, run_name: str) -> LocalCluster | None:
        """The record of `run_name` on this machine, or None if no local cluster was ever started for it."""
        try:
            return cls(**json.loads(cls.path(run_name).read_text()))
        except FileNotFoundError:
            return None

    def save(self) -> None:
        """Write the record atomically (readers never see half of it)."""
        RECORDS.mkdir(parents=True, exist_ok=True)
        path = self.path(self.run)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(asdict(self)))
        partial.replace(path)

    @property
    def running(self) -> bool:
        """Whether the head process (hence the cluster) is up."""
        return process_alive(self.head_pid, HEAD_MODULE)

    def prepare_join(self) -> None:
        """Make this process able to join the cluster by its address: Ray turns token authentication on for a new
        local cluster (the token in ~/.ray/auth_token), but a process that joins by address must say so itself,
        with RAY_AUTH_MODE (an explicit setting of it is left as it is)."""
        if not self.auth_mode or os.environ.get(AUTH_MODE):
            return
        os.environ[AUTH_MODE] = self.auth_mode
        if "ray" in sys.modules:  # Ray read the mode when it was imported: have it read it again, as ray.init does
            from ray._raylet import Config

            Config.initialize("")

    def record_outcome(self, outcome: dict[str, Any]) -> None:
        """Record how the run ended, unless someone (the driver, `tandem ray stop`, the head) recorded it first;
        a record that is gone or now belongs to a newer run of the same name is left alone."""
        current = self.load(self.run)
        if current is None or current.head_pid != self.head_pid:
            self.outcome = self.outcome or outcome
            return
        if current.outcome is None:
            current.outcome = outcome
            current.save()
        self.outcome = current.outcome

    def over_line(self) -> str:
        """One line for a run whose local cluster is gone: how it ended, if that was recorded."""
        if self.outcome is None:
            return (
                f"run {self.run} is over: its local Ray cluster (head pid {self.head_pid}) is gone and no outcome was "
                f"recorded; see {self.run_dir}/logs"
            )
        return (
            f"run {self.run} is over: {self.outcome['outcome']} (code {self.outcome['code']}); the local Ray cluster "
            f"it started has shut down (logs in {self.run_dir}/logs)"
        )

    def shut_down(self, outcome: dict[str, Any]) -> None:
        """Record `outcome`, then end the head: a live driver other than this process is given DRIVER_END_S to
        do it itself (it is ending its run); then SIGTERM, and SIGKILL of the head's process group after
        HEAD_STOP_S. Returns once the head is gone."""
        self.record_outcome(outcome)
        if self.driver_pid != os.getpid() and process_alive(self.driver_pid):
            wait_gone(self.head_pid, DRIVER_END_S)
        if not self.running:
            return
        with suppress(ProcessLookupError):  # it may end by itself meanwhile
            os.kill(self.head_pid, signal.SIGTERM)
            if not wait_gone(self.head_pid, HEAD_STOP_S):
                os.killpg(self.head_pid, signal.SIGKILL)  # the head leads its own session and process group
                wait_gone(self.head_pid, HEAD_STOP_S)


def process_alive(pid: int, command_part: str = "") -> bool:
    """Whether process `pid` runs (a zombie does not), with `command_part` in its command line if given."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z" and command_part in cmdline


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait until process `pid` has ended (or is a zombie); whether it has."""
    deadline = time.monotonic() + timeout_s
    while process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def busy_problem(run_name: str) -> str | None:
    """Why a new local cluster cannot be started for `run_name` (one of that name runs on this machine), else None."""
    record = LocalCluster.load(run_name)
    if record is None or not record.running:
        return None
    return (
        f"a run named '{run_name}' is running on this machine's local Ray (head pid {record.head_pid}): choose "
        f"another --run.name, or `tandem ray stop {run_name}`"
    )


def forget(run_name: str) -> None:
    """Drop the record of a local cluster of `run_name` that has ended (a new run of that name runs elsewhere)."""
    record = LocalCluster.load(run_name)
    if record is not None and not record.running:
        LocalCluster.path(run_name).unlink(missing_ok=True)


def start_local(run_name: str, run_dir: Path, dashboard: bool, object_store_mb: int) -> LocalCluster:
    """Start the head of a local cluster for `run_name` (see busy_problem first) and return its record once it is
    up; RuntimeError with the head's output if it exits or is not up within START_TIMEOUT_S."""
    from launch.local import Role

    LocalCluster.path(run_name).unlink(missing_ok=True)
    argv = [sys.executable, "-m", HEAD_MODULE, run_name, str(run_dir), str(os.getpid())]
    argv += ["--dashboard", str(dashboard).lower(), "--object-store-mb", str(object_store_mb)]
    head = Role("ray-head-0", argv, None)
    head.start(run_dir)  # its own session: survives this process, and a Ctrl-C in its terminal
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        record = LocalCluster.load(run_name)
        if record is not None and record.head_pid == head.process.pid:
            return record
        if head.poll() is not None:
            raise RuntimeError(f"the local Ray head exited with code {head.poll()}:\n{head.tail()}")
        time.sleep(0.1)
    head.kill_group()
    raise RuntimeError(f"the local Ray head was not up within {START_TIMEOUT_S:.0f}s:\n{head.tail()}")


# ---------------------------------------------------------------------------------------------- the head process
def main(argv: list[str]) -> int:
    """`python -m launch.ray.local RUN RUN_DIR DRIVER_PID [--dashboard B] [--object-store-mb N]` (start_local)."""
    import ray

    from launch.ray.plan import NAMESPACE

    parser = argparse.ArgumentParser(prog=HEAD_MODULE)
    parser.add_argument("run")
    parser.add_argument("run_dir")
    parser.add_argument("driver_pid", type=int)
    parser.add_argument("--dashboard", choices=("true", "false"), default="false")
    parser.add_argument("--object-store-mb", type=int, default=0)
    args = parser.parse_args(argv)
    ray.init(
        address="local",  # a new Ray of this machine alone, even if one runs; its processes are our children
        namespace=NAMESPACE,
        include_dashboard=args.dashboard == "true",
        object_store_memory=args.object_store_mb * (1 << 20) or None,
        log_to_driver=False,
    )  # before this, a SIGTERM kills the head and Ray's processes with it (they share its fate)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs a SIGTERM handler of its own
        signal.signal(sig, lambda _s, _f: stopping.set())
    try:
        address = ray.get_runtime_context().gcs_address
        record = LocalCluster(
            args.run, args.run_dir, args.driver_pid, os.getpid(), address, os.environ.get(AUTH_MODE, "")
        )
        record.save()
        print(f"local Ray for run {args.run} up at {record.address}", flush=True)
        keep(record, stopping)
    finally:
        ray.shutdown()
    print(f"local Ray for run {args.run} shut down", flush=True)
    return 0


def keep(record: LocalCluster, stopping: threading.Event) -> None:
    """Return when the cluster should end (see the module docstring): on `stopping`, or once the driver is gone
    and the run with it."""
    gone_since = over_since = None
    while not stopping.wait(POLL_S):
        if process_alive(record.driver_pid):
            continue
        now = time.monotonic()
        controller, outcome = controller_state(record.run)
        if controller is None:
            gone_since = gone_since or now
            if now - gone_since >= GONE_S:
                record.record_outcome(
                    {"outcome": f"ended: its driver (pid {record.driver_pid}) and its controller are gone", "code": 1}
                )
                return
            continue
        gone_since = None
        over_since = (over_since or now) if outcome is not None else None
        if over_since is not None and now - over_since >= LINGER_S:
            import ray

            ray.kill(controller, no_restart=True)
            record.record_outcome(outcome)
            return


def controller_state(run_name: str) -> tuple[Any, dict[str, Any] | None]:
    """(the run's controller or None, its outcome if the run is over and nobody follows it, else None). A
    controller that dies or hangs during the call counts as present and running: the next poll sees it again."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from launch.ray.control import FOLLOWER_SILENT_S
    from launch.ray.plan import NAMESPACE, controller_name

    try:
        controller = ray.get_actor(controller_name(run_name), namespace=NAMESPACE)
    except ValueError:
        return None, None
    try:
        outcome, followed = ray.get(
            [controller.ended_with.remote(), controller.followed.remote(FOLLOWER_SILENT_S)], timeout=CALL_S
        )
    except (RayActorError, GetTimeoutError) as error:
        print(f"the controller of run {run_name} did not answer: {type(error).__name__}", flush=True)
        return controller, None
    return controller, (None if followed else outcome)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
