"""`tandem ray CONFIG`: the buffer, the learner rank(s), the generators and (with env.reward_model, unless
reward.in_process) the reward service as Ray actors on a Ray cluster.

    ray start --head                                        # once per cluster (docs/ray.md: the other nodes)
    RAY_ADDRESS=auto tandem ray gpu_cluster --run.name exp1 # a packaged config by name, or a TOML file
    tandem ray demo --run.simulate true                     # no address: a local Ray on this machine
    tandem ray scale exp1 --generators 12                   # from any shell that reaches the cluster
    tandem ray status exp1
    tandem ray stop exp1

What this process does: joins the cluster (`ray.address`, else RAY_ADDRESS, else a local Ray that it starts as a
head process of its own, launch.ray.local), checks
that the cluster can hold the fleet at all, creates the run's controller — the named, detached actor
`tandem:<run>:controller` (launch.ray.fleet) that places, starts, supervises and scales the roles — and then
follows the run: a progress bar from `<run_dir>/metrics.jsonl` (when the run directory is visible on this
machine) until the controller reports the outcome.

Exit codes: 0 the learner finished; 1 a role failed beyond what the controller may repair (its reason and log
tail are printed); 2 the config or the cluster cannot hold this run, or its run directory holds another run
(`common.run_dir`), or it asks for run.placement = "colocated" (a `tandem run` placement: refused, never
ignored, so that a run is never silently placed otherwise than written); 130 Ctrl-C / SIGTERM (fleet stopped).
The controller is killed when this process ends, and the local Ray it started is shut down. If this process is
killed hard, the detached controller keeps the fleet running, on a joined cluster and on the local one alike (its
head runs in its own session): `tandem ray status RUN` / `tandem ray stop RUN` reach it from any shell, and the
stop also shuts the local Ray down (so does the run's own end: see launch.ray.local).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from common.config import TandemConfig
from common.logs import setup_logging
from common.run_dir import reuse_problem
from common.signals import caught_signals
from launch.local import nodes_refused, resumed_from
from launch.progress import RunProgress, summarize
from launch.ray.local import LocalCluster, busy_problem, forget, start_local
from launch.ray.plan import NAMESPACE, capacity_problem, controller_name, resource_demand

FOLLOW_S = 1.0
PLACEMENT_REFUSED = (
    'run.placement: "colocated" is a `tandem run` placement (every role pinned to every core of one machine); '
    'Ray places each role on a node by its CPU and GPU resources: leave run.placement out ("split") for '
    "`tandem ray`, or use `tandem run`"
)
DRIVER_FAILED = {"outcome": "failed: tandem ray itself failed (see its output)", "code": 1}  # until one is known


def run(config: TandemConfig) -> int:
    """Launch the fleet on Ray and follow it to its end; returns the exit code (see the module docstring)."""
    if config.run.placement != "split":  # before Ray starts: a `tandem run` placement, meaningless on Ray
        print(f"tandem ray: {PLACEMENT_REFUSED}", file=sys.stderr)
        return 2
    if refused := nodes_refused(config, "Ray places learner.world_size ranks on its nodes itself"):
        print(f"tandem ray: {refused}", file=sys.stderr)
        return 2
    import ray

    run_dir = config.run.run_dir.resolve()
    reused = reuse_problem(run_dir, config.learner.resume, whole_run=True)
    if reused:  # before Ray starts or any role writes into it
        print(f"tandem ray: {reused}", file=sys.stderr)
        return 2
    busy = None if joined_address(config) else busy_problem(config.run.name)
    if busy:
        print(f"tandem ray: {busy}", file=sys.stderr)
        return 2
    log = setup_logging("launcher", 0, run_dir, simulation=config.run.simulate)
    local = connect(config, run_dir)
    outcome = DRIVER_FAILED
    try:
        problem = fleet_problem(config)
        if problem:
            outcome = {"outcome": f"refused: {problem}", "code": 2}
            print(f"tandem ray: {problem}", file=sys.stderr)
            return 2
        controller = create_controller(config, local is not None)
        mode = "SIMULATION (no vLLM, no DeepSpeed)" if config.run.simulate else "real engines"
        log.info(
            "run %s on Ray (%s cluster, %s); run directory %s",
            config.run.name,
            f"local (head pid {local.head_pid})" if local else "joined",
            mode,
            run_dir,
        )
        start, first_step = time.time(), resumed_from(config)
        outcome = follow(controller, config, log)
        return report(outcome, config, time.time() - start, first_step)
    finally:
        ray.shutdown()
        if local is not None:
            local.shut_down(outcome)  # the outcome recorded for `tandem ray status RUN`; every Ray process ends


def joined_address(config: TandemConfig) -> str:
    """The cluster to join (`ray.address`, else RAY_ADDRESS), or "" for a local Ray of this run."""
    return config.ray.address or os.environ.get("RAY_ADDRESS", "")


def connect(config: TandemConfig, run_dir: Path) -> LocalCluster | None:
    """Join the cluster, or start a local Ray for this run and join it (its record is returned then: roles bind
    loopback). The local Ray is a head process of its own (launch.ray.local), so that it outlives this one."""
    import ray

    address = joined_address(config)
    if address:
        forget(config.run.name)  # a local cluster of this name that has ended: `tandem ray status` asks here now
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
        return None
    local = start_local(config.run.name, run_dir, config.ray.dashboard, config.ray.object_store_mb)
    try:
        local.prepare_join()
        ray.init(address=local.address, namespace=NAMESPACE, log_to_driver=True)
    except BaseException:
        local.shut_down({"outcome": "failed: the driver could not join the local Ray it started", "code": 1})
        raise
    return local


def fleet_problem(config: TandemConfig) -> str | None:
    """Why this run cannot start on the connected cluster (too few resources, name taken), else None."""
    import ray

    total = ray.cluster_resources()
    problem = capacity_problem(resource_demand(config), total, config.generator.count, config.reward_service)
    if problem:
        return problem
    try:
        ray.get_actor(controller_name(config.run.name), namespace=NAMESPACE)
    except ValueError:
        return None
    return (
        f"a run named '{config.run.name}' is already on this cluster: choose another --run.name, "
        f"or `tandem ray stop {config.run.name}`"
    )


def create_controller(config: TandemConfig, local_cluster: bool) -> Any:
    """The run's detached controller actor (it holds no resources: it only coordinates)."""
    import ray

    from launch.ray.fleet import FleetController

    data = config.model_dump(mode="json")
    data["run"]["root"] = str(config.run.root.resolve())  # the controller and the roles run elsewhere
    return (
        ray.remote(FleetController)
        .options(
            name=controller_name(config.run.name),
            namespace=NAMESPACE,
            lifetime="detached",
            max_concurrency=8,
            num_cpus=0,
            max_restarts=0,
        )
        .remote(data, local_cluster)
    )


def follow(controller: Any, config: TandemConfig, log: Any) -> dict[str, Any]:
    """Start the fleet, show progress until the controller reports the outcome ({"outcome", "code"}, returned),
    stop the fleet on a signal."""
    import ray
    from ray.exceptions import RayActorError

    run_dir = config.run.run_dir.resolve()
    with caught_signals() as interrupted:
        try:
            status = ray.get(controller.start.remote())
            outcome = status["outcome"]
            if outcome is None:
                log.info(
                    "fleet up: buffer %s, weights %s, reward service %s, %d generator(s) on %s",
                    status["buffer_address"],
                    status["weights_address"],
                    status["reward_address"] or "none",
                    len(status["generators"]),
                    sorted({g["node"] for g in status["generators"]}),
                )
                with RunProgress(run_dir / "metrics.jsonl", config.learner.total_steps) as progress:
                    while outcome is None and not interrupted:
                        outcome = ray.get(controller.wait.remote(FOLLOW_S))
                        progress.refresh()
            if outcome is None:
                outcome = ray.get(controller.stop.remote(signal.Signals(interrupted[0]).name))
        except RayActorError as error:  # killed from outside (ray.kill, `ray stop`): its members went with it
            log.error("the controller of run %s died: %s", config.run.name, error)
            outcome = {"outcome": "failed: the run's controller died (its roles were stopped with it)", "code": 1}
        finally:
            ray.kill(controller, no_restart=True)
    return outcome


def report(outcome: dict[str, Any], config: TandemConfig, wall_s: float, first_step: int = 0) -> int:
    """Print the run's summary (it finished: this session's steps after `first_step`, and the whole run's) or how
    it ended; returns the exit code."""
    if outcome["code"] == 0:
        print(summarize(config.run.run_dir.resolve(), wall_s=wall_s, first_step=first_step))
    else:
        print(f"\ntandem ray: run {config.run.name} {outcome['outcome']}", file=sys.stderr)
    return int(outcome["code"])
