"""A real single-node Slurm cluster on this machine: munged, slurmctld and slurmd (Debian's slurm-wlm), started here
with a config of our own in a temporary folder, and stopped whatever happens.

    with slurm_lab() as env:                                  # env: os.environ + SLURM_CONF
        subprocess.run(["sbatch", "--wrap", "hostname"], env=env)

The node is this machine under its own name, at 127.0.0.1 (no name resolution needed), declaring CPUS CPUs whatever
it has (`SlurmdParameters=config_overrides`) so that a run's jobs (a buffer, a learner, a generator array) all
start at once on a 2-core machine, as they would on a cluster; processes are tracked without cgroups
(`proctrack/linuxproc`, `task/none`), which a container may not delegate. The daemons listen on free ports, so a
cluster of the machine's own (port 6817) is left alone; munged is reused if one runs.

Failure modes: `check_lab()` raises `LabUnavailable` naming what is missing: root, or slurm-wlm (`apt-get install
-y slurm-wlm`: .ci/run installs it); a daemon that does not come up raises it with the tail of its log.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.sockets import free_port

PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel")
CPUS = 32
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")


class LabUnavailable(RuntimeError):
    """This machine cannot run the lab (the message says what to change)."""


def check_lab() -> None:
    if os.geteuid() != 0:
        raise LabUnavailable("the Slurm lab runs its daemons as root: run as root")
    missing = [program for program in PROGRAMS if shutil.which(program) is None]
    if missing:
        raise LabUnavailable(f"{', '.join(missing)} not found: apt-get install -y slurm-wlm (.ci/run does)")


def slurm_conf(folder: Path, node: str, ctld_port: int, slurmd_port: int) -> str:
    return f"""ClusterName=tandemlab
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SchedulerParameters=sched_interval=1
NodeName={node} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory=4000 State=UNKNOWN
PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@contextmanager
def slurm_lab(timeout_s: float = 60.0) -> Iterator[dict[str, str]]:
    """Start the daemons, wait for the node to be idle, yield the environment for Slurm's commands, stop them."""
    check_lab()
    folder = Path(tempfile.mkdtemp(prefix="tandem-slurm-"))
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    node = socket.gethostname().split(".")[0]
    conf = folder / "slurm.conf"
    conf.write_text(slurm_conf(folder, node, free_port(), free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started: list[subprocess.Popen] = []
    try:
        if not MUNGE_SOCKET.exists():
            MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
            shutil.chown(MUNGE_SOCKET.parent, "munge", "munge")
            started.append(subprocess.Popen(["runuser", "-u", "munge", "--", "munged", "--foreground"]))
            _wait(MUNGE_SOCKET.exists, timeout_s, "munged's socket", folder)
        started.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=env))
        started.append(subprocess.Popen(["slurmd", "-D", "-f", str(conf)], env=env))
        _wait(lambda: _node_ready(env), timeout_s, "the node to be idle", folder)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True, check=False)
        for process in reversed(started):
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _node_ready(env: dict[str, str]) -> bool:
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, check=False)
    return out.returncode == 0 and out.stdout.strip() in ("idle", "mixed", "allocated")


def _wait(condition, timeout_s: float, what: str, folder: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            logs = "".join(
                f"\n--- {log.name}\n{log.read_text(errors='replace')[-1500:]}" for log in sorted(folder.glob("*.log"))
            )
            raise LabUnavailable(f"no {what} after {timeout_s:g}s{logs}")
        time.sleep(0.2)


def jobs_left(env: dict[str, str], run_name: str) -> list[str]:
    """The lab's jobs of run `run_name` still queued or running (`squeue`)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], env=env, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if f"tandem-{run_name}-" in line]
