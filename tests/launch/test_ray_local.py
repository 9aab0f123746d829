"""`tandem ray` with no cluster named: the local Ray it starts is a head of its own (launch.ray.local), so that

- a SIGKILLed driver leaves the cluster and the run going: `tandem ray status RUN` answers, `tandem ray stop RUN`
  stops the fleet and the local cluster, and afterwards `status` says in one line how the run ended;
- a driver that ends (here: its run refused) shuts its local cluster down, and `status` says so in one line.

The refused run is started with the module (a fixture) and looked at by its test: it runs while the killed-driver
test does (each has a local cluster of its own, under its own run name; most of either is Ray starting processes).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.ray.local import LocalCluster
from tests.launch.ray_runs import SIM_CONFIG, RayLaunch, control, processes_of, session_processes, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]


def shut_down_leftover(name: str) -> None:
    """Whatever a failed test left: the run's local cluster, with every Ray process of it; then its record."""
    record = LocalCluster.load(name)
    if record is not None and record.running:
        record.shut_down({"outcome": "stopped by the test's clean-up", "code": 1})
    LocalCluster.path(name).unlink(missing_ok=True)


@pytest.fixture(scope="module", autouse=True)
def refused(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, RayLaunch]]:
    """(run name, launch) of a run its local cluster cannot hold (64 CPUs per generator), started at once."""
    name = f"local-end-{os.getpid()}"
    launch = RayLaunch(
        tmp_path_factory.mktemp("refused"),
        name,
        "",
        None,
        SIM_CONFIG,
        "--ray.generator_cpus",
        "64",
        "--ray.dashboard",
        "false",
    )
    try:
        yield name, launch
    finally:
        launch.close()
        shut_down_leftover(name)


def test_local_cluster_outlives_a_killed_driver(tmp_path: Path) -> None:
    name = f"local-kill-{os.getpid()}"  # the record of a local cluster is per run name on this machine
    launch = RayLaunch(
        tmp_path, name, "", None, SIM_CONFIG, "--learner.total_steps", "100000", "--ray.dashboard", "false"
    )
    try:
        steps = len(launch.wait_steps(2, timeout_s=120))
        record = LocalCluster.load(name)
        assert record is not None and record.running, record
        os.kill(launch.pid, signal.SIGKILL)
        assert launch.wait_exit(timeout_s=30) == -signal.SIGKILL

        status = control("status", name)
        assert status.returncode == 0 and f"run {name}: running" in status.stdout, status.stdout + status.stderr
        wait_for(lambda: len(launch.records()) > steps + 2, 60, "the learner to train on without its driver")

        stopped = control("stop", name)
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout == f"run {name}: stopped: tandem ray stop (code 130)\n", stopped.stdout
        assert not record.running and not session_processes(record.head_pid), session_processes(record.head_pid)
        assert not processes_of(launch.run_dir), processes_of(launch.run_dir)

        over = control("status", name)
        assert over.returncode == 1 and over.stdout == "", over.stdout
        assert over.stderr.count("\n") == 1, over.stderr  # one line, no traceback
        assert f"run {name} is over: stopped: tandem ray stop (code 130)" in over.stderr, over.stderr
    finally:
        launch.close()
        shut_down_leftover(name)


def test_local_cluster_ends_with_its_driver(refused: tuple[str, RayLaunch]) -> None:
    name, launch = refused
    assert launch.wait_exit(timeout_s=120) == 2, launch.tail()
    record = LocalCluster.load(name)
    assert record is not None and not record.running, record  # shut down before the driver exited
    assert not session_processes(record.head_pid), session_processes(record.head_pid)
    over = control("status", name)
    assert over.returncode == 1 and over.stderr.count("\n") == 1, over.stderr
    assert f"run {name} is over: refused: the Ray cluster has" in over.stderr, over.stderr
