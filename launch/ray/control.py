"""Reach a running `tandem ray` fleet from any process that can join its cluster: scale, status, stop.

    tandem ray scale my-run --generators 8 [--address HOST:6379]
    tandem ray status my-run [--json]
    tandem ray stop my-run

    from launch.ray.control import scale_generators, fleet_status
    scale_generators("my-run", 8)          # -> the fleet's status after the change

Each call finds the run's controller actor by name (`tandem:<run>:controller`, namespace `tandem`) on the
cluster at `address`, else RAY_ADDRESS, else the local cluster that `tandem ray` started on this machine for that
run (launch.ray.local keeps a record of it per run name), else `auto` (a Ray started on this machine by `ray
start`). A process that is already connected to Ray (a test, a notebook) is reused as it is.

Failure modes, each one line on the command line (exit codes: 0 done, 1 no such run / over / unreachable /
refused, 2 the cluster cannot hold the scale-up): LookupError when the run is not on the cluster, is over (its
local cluster has shut down: the record says how it ended) or the cluster cannot be reached; ValueError (from the
controller) when the run has ended; PlacementError when the cluster cannot place more generators (at once when its
free CPUs/GPUs are too few).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from typing import Any

from launch.ray.local import LocalCluster
from launch.ray.placement import PlacementError
from launch.ray.plan import NAMESPACE, controller_name

FOLLOWER_SILENT_S = 10.0  # a follower asks every second; silent this long, it is gone
# The stop's outcome when the run's follower (`tandem ray CONFIG`) removed the controller as the stop ended the run,
# before the reply left it (seen under load: the caller got ActorDiedError for a stop that had worked).
STOPPED_BEFORE_THE_REPLY = {"outcome": "stopped: tandem ray stop", "code": 130}
REACH_TIMEOUT_S = 3.0  # a cluster address that accepts no TCP connection in this long is unreachable


def controller(run_name: str, address: str | None = None) -> Any:
    """The controller actor of `run_name`; joins the cluster first if this process is not connected."""
    return reach(run_name, address)[0]


def reach(run_name: str, address: str | None = None) -> tuple[Any, LocalCluster | None]:
    """(the controller of `run_name`, the record of the local cluster this process joined for it, or None).
    LookupError, with one line that says why, when the run cannot be reached (see the module docstring)."""
    import ray

    local = None if ray.is_initialized() else join(run_name, address)
    try:
        return ray.get_actor(controller_name(run_name), namespace=NAMESPACE), local
    except ValueError:
        raise LookupError(
            f"no run named '{run_name}' on this Ray cluster (its controller '{controller_name(run_name)}' is not alive)"
        ) from None


def join(run_name: str, address: str | None) -> LocalCluster | None:
    """Connect this process to the cluster of `run_name` (see the module docstring); returns the local cluster's
    record when that is where it went. Never a traceback for a cluster that is not there: LookupError."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS", "")
    local = None
    if not address:
        local = LocalCluster.load(run_name)
        if local is not None and not local.running:
            raise LookupError(local.over_line())
        address = local.address if local is not None else "auto"
        if local is not None:
            local.prepare_join()
    problem = unreachable(address)
    if problem:
        raise LookupError(f"cannot reach run '{run_name}': {problem}")
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.ERROR)
    except ConnectionError:  # "auto" found no Ray on this machine
        raise LookupError(
            f"no run named '{run_name}' is running here: no Ray cluster runs on this machine and no local one was "
            f"started for it (for a cluster elsewhere pass --address HOST:6379 or set RAY_ADDRESS)"
        ) from None
    return local


def unreachable(address: str) -> str | None:
    """Why a `host:port` (or `ray://host:port`) cluster address accepts no connection, else None; Ray's own
    connect would retry for a minute or more."""
    if address in ("auto", "local"):
        return None
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not port.isdigit():
        return None  # Ray says what is wrong with it
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as error:
        return f"the Ray cluster at {address} does not answer ({error.strerror or error}); is it up (`ray status`)?"
    return None


def scale_generators(run_name: str, count: int, address: str | None = None) -> dict[str, Any]:
    """Run `count` generators in `run_name` (new ones fetch the newest weights; retired ones get SIGTERM)."""
    import ray

    return ray.get(controller(run_name, address).scale_generators.remote(count))


def fleet_status(run_name: str, address: str | None = None) -> dict[str, Any]:
    import ray

    return ray.get(controller(run_name, address).status.remote())


def stop_fleet(run_name: str, address: str | None = None) -> dict[str, Any]:
    """Stop every role of the run in order; returns the outcome. The controller is then removed by the run's
    follower (`tandem ray CONFIG`, which reports the outcome and exits 130), or here if nobody follows it. A
    local cluster that `tandem ray` started for the run is shut down too (by its driver, if that still runs)
    before this returns."""
    import ray
    from ray.exceptions import RayActorError

    handle, local = reach(run_name, address)
    outcome = STOPPED_BEFORE_THE_REPLY
    try:
        outcome = ray.get(handle.stop.remote("tandem ray stop"))
        followed = ray.get(handle.followed.remote(FOLLOWER_SILENT_S))
    except RayActorError:  # the follower saw the run end and removed the controller (before the reply, maybe)
        followed = True
    if not followed:
        ray.kill(handle, no_restart=True)
    if local is not None:
        ray.shutdown()  # before the cluster goes: this process leaves it quietly
        local.shut_down(outcome)
    return outcome


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem ray", description="Control a fleet started by `tandem ray CONFIG`.")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    scale = sub.add_parser("scale", help="add or retire generators while the learner trains")
    scale.add_argument("run", help="run.name of the fleet")
    scale.add_argument("--generators", type=_count, required=True, help="generators to run from now on (>= 0)")
    status = sub.add_parser(
        "status",
        help="print the fleet's members (the reward service too), endpoints and restarts (exit 1: not running)",
    )
    status.add_argument("run")
    stop = sub.add_parser("stop", help="stop every role of the run (generators, learners, reward service, buffer)")
    stop.add_argument("run")
    for cmd in (scale, status, stop):
        cmd.add_argument(
            "--address",
            default=None,
            help="Ray cluster address (default: RAY_ADDRESS, else the local Ray that `tandem ray` started for RUN, else auto)",
        )
        cmd.add_argument("--json", action="store_true", help="print the reply as JSON")
    return parser


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (got {value})")
    return value


def main(argv: list[str]) -> int:
    """`tandem ray scale|status|stop RUN ...`; returns the exit code: 0 done; 1 the run is not there, over,
    unreachable, or the controller refused; 2 the cluster cannot hold the generators asked for. A status of a
    run that is over is one line and exit 1."""
    args = _parser().parse_args(argv)
    try:
        if args.action == "scale":
            reply = scale_generators(args.run, args.generators, args.address)
        elif args.action == "status":
            reply = fleet_status(args.run, args.address)
        else:
            reply = stop_fleet(args.run, args.address)
    except PlacementError as error:
        print(f"tandem ray {args.action}: {message(error)}", file=sys.stderr)
        return 2
    except (LookupError, ValueError) as error:
        print(f"tandem ray {args.action}: {message(error)}", file=sys.stderr)
        return 1
    over = args.action == "status" and reply["outcome"] is not None
    if args.json:
        print(json.dumps(reply, indent=2))
    elif over:
        print(f"tandem ray status: run {args.run} is over: {_outcome(reply['outcome'])}", file=sys.stderr)
    else:
        print(_describe(args.run, reply))
    return 1 if over else 0


def message(error: BaseException) -> str:
    """What an error says, without the remote traceback that Ray wraps around an actor method's exception."""
    from ray.exceptions import RayTaskError

    return str(error.cause if isinstance(error, RayTaskError) else error)


def _outcome(outcome: dict[str, Any]) -> str:
    return f"{outcome['outcome']} (code {outcome['code']})"


def _describe(run_name: str, reply: dict[str, Any]) -> str:
    if "generators" not in reply:  # an outcome
        return f"run {run_name}: {_outcome(reply)}"
    members = [reply["buffer"], reply["reward"], *reply["learners"], *reply["generators"], *reply["retiring"]]
    reward = f"   reward {reply['reward_address']}" if reply["reward_address"] else ""
    lines = [
        f"run {reply['run']}: running",
        f"  buffer {reply['buffer_address']}   weights {reply['weights_address']}{reward}",
        f"  restarts {reply['restarts']}",
    ]
    lines += [
        f"  {m['name']:<14} node {m['node']:<15} pid {m['pid']}{'  (retiring)' if m['retiring'] else ''}"
        for m in members
        if m
    ]
    return "\n".join(lines)
