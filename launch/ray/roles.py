"""One Tandem role as a supervised subprocess inside a Ray actor: the unit that `tandem ray` places.

    RoleActor = ray.remote(concurrency_groups=CONCURRENCY)(RoleProcess)
    actor = RoleActor.options(name="tandem:my-run:generator-3", num_cpus=1, ...).remote("generator-3", run_dir)
    node = ray.get(actor.node.remote())                    # {"ip": ..., "node_id": ...}: where Ray placed it
    port = ray.get(actor.reserve_port.remote(host))        # a port free on that node, for the role to bind
    ray.get(actor.wait_port_free.remote(host, port, 15))   # or: a port a predecessor may still hold (a restart)
    ray.get(actor.start.remote(argv_tail, env, config_text))   # python -m launch.cli ROLE <run_dir>/config.json ...
    ray.get(actor.wait_listening.remote(port, 30))         # the role bound its port (or exited: its exit code)
    exited = actor.wait_exit.options(concurrency_group=WATCH).remote()   # resolves when the role exits
    ray.get(actor.stop.remote(20))                         # SIGTERM, a grace period, then SIGKILL of its group

Why a subprocess and not the role in the actor's thread: roles install signal handlers, and vLLM and DeepSpeed
start processes of their own; in a child process the role runs exactly as under `tandem run` (the same
`launch.local.Role`: own session, stdout/stderr in `<run_dir>/logs/<role>-<i>.out`).

Watching costs nothing while the role runs: `wait_exit` blocks in its own concurrency group (WATCH, one
thread), so the caller holds one pending ObjectRef per role, which resolves with the exit code — or fails with
RayActorError when the actor dies — and `ray.wait(..., timeout=0)` on those refs needs no call to any actor.
Every other method runs, one at a time, on the default group's single thread, which lives as long as the actor.

Lifetime: the child is started from that thread with PR_SET_PDEATHSIG = SIGTERM, so when the actor's worker
dies for any reason (`ray.kill`, its owner the fleet controller gone, a node lost) the role is told to stop: a
generator drains and returns its leases. The actor never restarts by itself (max_restarts = 0): the
controller decides what replaces it.

Imports here are light (no torch, vLLM or DeepSpeed); `ray` is imported only inside the methods that need it, so
the module itself imports without Ray.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

from common.sockets import free_port
from launch.local import Role

POLL_S = 0.1
WATCH = "watch"  # the concurrency group of `wait_exit`: ray.remote(concurrency_groups=CONCURRENCY)(RoleProcess)
CONCURRENCY = {WATCH: 1}


def ensure_file(path: Path, text: str) -> bool:
    """Make `path` hold exactly `text`; True if it was written. Atomic (unique temporary name, then rename), so
    several nodes sharing one file system may call it at once, and a node without it gets its own copy."""
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True


def gpu_isolated(env: dict[str, str], gpu_ids: list) -> dict[str, str]:
    """`env` for a role whose actor Ray gave `gpu_ids`: none -> CUDA_VISIBLE_DEVICES="" (Ray 2.60 no longer blanks it
    for an actor given no GPU, ray-project/ray#54868, so the role would see every GPU of its node and a reward model
    would load onto GPU 0 beside a vLLM; review finding 11). Given GPUs: Ray's own setting, inherited, stands."""
    return env if gpu_ids else {**env, "CUDA_VISIBLE_DEVICES": ""}


def port_taken(host: str, port: int) -> bool:
    """True when something on this machine listens on `host:port` (a bind with SO_REUSEADDR, as ZeroMQ binds,
    fails); connections of a closed listener left in TIME_WAIT do not count."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def is_listening(pid: int, port: int) -> bool:
    """True when process `pid` has a TCP socket listening on `port` (psutil, a Ray dependency)."""
    import psutil

    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in connections)


class RoleProcess:
    """Supervises one role process on the node where Ray placed this actor (see the module docstring).

    Ray runs its methods one at a time on one thread (PR_SET_PDEATHSIG needs the starting thread to live on),
    except `wait_exit`, which runs in the WATCH group and only waits on the child.
    """

    def __init__(self, name: str, run_dir: str) -> None:
        self.name = name  # "buffer-0", "learner-1", "generator-7"
        self.run_dir = Path(run_dir)
        self.role: Role | None = None

    def node(self) -> dict[str, str]:
        """Where this actor runs: {"ip": node IP, "node_id": Ray node id, "hostname": ...}."""
        import ray

        context = ray.get_runtime_context()
        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": context.get_node_id(),
            "hostname": socket.gethostname(),
        }

    def reserve_port(self, host: str) -> int:
        """A TCP port that is free on `host` now. The role binds it a moment later; if another process took it in
        between, the role exits with "address in use" and `wait_listening` reports that exit."""
        return free_port(host)

    def wait_port_free(self, host: str, port: int, timeout_s: float) -> bool:
        """Wait until nothing listens on `host:port` any more; False if something still does after `timeout_s`.
        For a role restarted on its predecessor's port: a predecessor whose actor died got only SIGTERM (from
        PR_SET_PDEATHSIG) and may still be closing its socket."""
        deadline = time.time() + timeout_s
        while port_taken(host, port):
            if time.time() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def start(self, argv_tail: list[str], env: dict[str, str], config_text: str) -> int:
        """Write the run's resolved config on this node (if it is not there already, identical) and start
        `python -m launch.cli <argv_tail[0]> <run_dir>/config.json <argv_tail[1:]>`; returns the child's pid.
        Raises RuntimeError if this actor already runs a role (one role per actor)."""
        if self.role is not None:
            raise RuntimeError(f"{self.name}: already started (pid {self.role.process.pid})")
        config_path = self.run_dir / "config.json"
        ensure_file(config_path, config_text)
        role, *extra = argv_tail
        argv = [sys.executable, "-m", "launch.cli", role, str(config_path), *extra]
        import ray

        self.role = Role(self.name, argv, None, env=gpu_isolated(env, ray.get_gpu_ids()), stop_with_parent=True)
        self.role.start(self.run_dir)
        return self.role.process.pid

    def wait_listening(self, port: int, timeout_s: float) -> int | None:
        """Wait until the role listens on `port`: None once it does; its exit code if it exited first.
        Raises TimeoutError (with the role's last output) if neither happened within `timeout_s`."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            code = self.poll()
            if code is not None:
                return code
            if is_listening(self.role.process.pid, port):
                return None
            time.sleep(POLL_S)
        raise TimeoutError(f"{self.name} did not listen on port {port} within {timeout_s:.0f}s:\n{self.tail()}")

    def wait_exit(self) -> int:
        """Block until the role exits; its exit code (negative: killed by that signal). Call it in the WATCH
        concurrency group, after `start`."""
        if self.role is None:
            raise RuntimeError(f"{self.name}: wait_exit before start")
        return self.role.process.wait()

    def poll(self) -> int | None:
        """None while the role runs (or was never started), else its exit code (negative: killed by a signal)."""
        return None if self.role is None else self.role.poll()

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the role, wait up to `grace_s` for it to exit, then SIGKILL its whole process group (which also
        reaches children whose parent already exited). Returns the exit code (None if never started)."""
        if self.role is None:
            return None
        self.role.signal(signal.SIGTERM)
        self.role.wait(time.time() + grace_s)
        self.role.kill_group()
        return self.role.poll()

    def tail(self, lines: int = 30) -> str:
        """The role's last lines of stdout/stderr (`logs/<name>.out`)."""
        return "(not started)" if self.role is None else self.role.tail(lines)
