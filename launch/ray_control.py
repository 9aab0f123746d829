"""Reach a running `tandem ray` fleet from any process that can join its cluster: scale, status, stop.

    tandem ray scale my-run --generators 8 [--address HOST:6379]
    tandem ray status my-run [--json]
    tandem ray stop my-run

    from launch.ray_control import scale_generators, fleet_status
    scale_generators("my-run", 8)          # -> the fleet's status after the change

Each call finds the run's controller actor by name (`tandem:<run>:controller`, namespace `tandem`) on the
cluster at `address` (else RAY_ADDRESS, else `auto`: a Ray started on this machine). A process that is
already connected to Ray (a test, a notebook) is reused as it is. Failure modes: LookupError when no run of
that name is on the cluster; ValueError (from the controller) when the run has ended or the count is < 0;
PlacementError when the cluster cannot place more generators.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from launch.ray_placement import PlacementError
from launch.ray_plan import NAMESPACE, controller_name

FOLLOWER_SILENT_S = 10.0  # a follower asks every second; silent this long, it is gone


def controller(run_name: str, address: str | None = None) -> Any:
    """The controller actor of `run_name`; joins the cluster first if this process is not connected."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", namespace=NAMESPACE, log_to_driver=False)
    try:
        return ray.get_actor(controller_name(run_name), namespace=NAMESPACE)
    except ValueError:
        raise LookupError(
            f"no run named '{run_name}' on this Ray cluster (its controller '{controller_name(run_name)}' is not alive)"
        ) from None


def scale_generators(run_name: str, count: int, address: str | None = None) -> dict[str, Any]:
    """Run `count` generators in `run_name` (new ones fetch the newest weights; retired ones get SIGTERM)."""
    import ray

    return ray.get(controller(run_name, address).scale_generators.remote(count))


def fleet_status(run_name: str, address: str | None = None) -> dict[str, Any]:
    import ray

    return ray.get(controller(run_name, address).status.remote())


def stop_fleet(run_name: str, address: str | None = None) -> dict[str, Any]:
    """Stop every role of the run in order; returns the outcome. The controller is then removed by the run's
    follower (`tandem ray CONFIG`, which reports the outcome and exits 130), or here if nobody follows it."""
    import ray
    from ray.exceptions import RayActorError

    handle = controller(run_name, address)
    outcome = ray.get(handle.stop.remote("tandem ray stop"))
    try:
        followed = ray.get(handle.followed.remote(FOLLOWER_SILENT_S))
    except RayActorError:  # the follower saw the outcome first and has already removed the controller
        return outcome
    if not followed:
        ray.kill(handle, no_restart=True)
    return outcome


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem ray", description="Control a fleet started by `tandem ray CONFIG`.")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    scale = sub.add_parser("scale", help="add or retire generators while the learner trains")
    scale.add_argument("run", help="run.name of the fleet")
    scale.add_argument("--generators", type=int, required=True, help="generators to run from now on")
    status = sub.add_parser("status", help="print the fleet's members, endpoints and restarts")
    status.add_argument("run")
    stop = sub.add_parser("stop", help="stop every role of the run (generators, learners, buffer)")
    stop.add_argument("run")
    for cmd in (scale, status, stop):
        cmd.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, else auto)")
        cmd.add_argument("--json", action="store_true", help="print the reply as JSON")
    return parser


def main(argv: list[str]) -> int:
    """`tandem ray scale|status|stop RUN ...`; returns the exit code (1: no such run, or the controller refused)."""
    args = _parser().parse_args(argv)
    try:
        if args.action == "scale":
            reply = scale_generators(args.run, args.generators, args.address)
        elif args.action == "status":
            reply = fleet_status(args.run, args.address)
        else:
            reply = stop_fleet(args.run, args.address)
    except (LookupError, ValueError, PlacementError) as error:
        print(f"tandem ray {args.action}: {error}", file=sys.stderr)
        return 1
    print(json.dumps(reply, indent=2) if args.json else _describe(reply))
    return 0


def _describe(reply: dict[str, Any]) -> str:
    if "generators" not in reply:  # an outcome
        return f"{reply['outcome']} (code {reply['code']})"
    members = [reply["buffer"], *reply["learners"], *reply["generators"], *reply["retiring"]]
    lines = [
        f"run {reply['run']}: {reply['outcome']['outcome'] if reply['outcome'] else 'running'}",
        f"  buffer {reply['buffer_address']}   weights {reply['weights_address']}",
        f"  restarts {reply['restarts']}",
    ]
    lines += [
        f"  {m['name']:<14} node {m['node']:<15} pid {m['pid']}{'  (retiring)' if m['retiring'] else ''}"
        for m in members
        if m
    ]
    return "\n".join(lines)
