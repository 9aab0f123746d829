"""A small network on one machine: hosts in their own network namespaces, joined by a bridge over rate-capped links.

    with lab(hosts=17, rate_mbit=200) as net:        # net.hosts[0] = 10.213.0.1, net.hosts[1] = 10.213.0.2, ...
        subprocess.Popen(net.exec_argv(1, [sys.executable, "-m", "benchmarks.weight_fanout", ...]))

Layout: one namespace `PREFIX<pid>-br` holds a bridge with no address; each host is a namespace `PREFIX<pid>-h<i>`
with its loopback up and one veth pair onto the bridge (`PREFIX<pid>h<i>` in the host, `PREFIX<pid>b<i>` on the
bridge), its address `SUBNET.<i + 1>/24` (10.213.0.0/24: it exists only inside these namespaces, nothing outside
routes to or from it). Both directions of every host's link are capped by `tc` token buckets at `rate_mbit`: the
egress of the host's end (its upload) and the egress of the bridge's end (its download). So a host's link behaves
like a NIC of that rate, whatever the loopback of the machine could do.

Lifetime: everything is removed in the context manager's `finally`, at interpreter exit (a SIGTERM handler turns
the signal into SystemExit, when `lab()` runs in the main thread), and, for what a SIGKILL left behind, at the
next `lab()` start: namespaces and links with this prefix whose pid is no longer alive are deleted. A live lab of
another process is never touched.

Failure modes: `check_lab()` (also run by `lab()`) raises `LabUnavailable` naming what is missing: root (or
CAP_NET_ADMIN), the `ip`/`tc` programs (iproute2: `apt-get install -y iproute2`), or the kernel's permission to
create namespaces, veth pairs and token buckets (a container without CAP_SYS_ADMIN cannot). A failed command
inside `lab()` raises `LabUnavailable` with the command and its stderr, after removing what was built.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from common.processes import pid_alive

PREFIX = "twf"  # interface names have at most 15 characters: "twf" + pid (<= 7 digits) + "b" + index (<= 3)
SUBNET = "10.213.0"  # /24, private to the namespaces
MAX_HOSTS = 250
BRIDGE = "br0"


class LabUnavailable(RuntimeError):
    """This machine cannot build the namespaces (the message says what to change)."""


@dataclass
class Lab:
    """A built lab: `namespaces[i]` and `hosts[i]` (address) per host, the cap per direction of each link."""

    prefix: str
    namespaces: list[str]
    hosts: list[str]
    links: list[str]  # the host-side interface of each host's veth pair
    rate_mbit: float

    def exec_argv(self, index: int, argv: list[str]) -> list[str]:
        """`argv` run inside host `index`'s namespace (same filesystem, clock and pids; its own network)."""
        return ["ip", "netns", "exec", self.namespaces[index], *argv]

    def tx_bytes(self, index: int) -> int:
        """Bytes host `index` has sent on its link (the kernel's counter: payload + TCP/IP headers)."""
        counter = f"/sys/class/net/{self.links[index]}/statistics/tx_bytes"
        return int(_run(["ip", "netns", "exec", self.namespaces[index], "cat", counter]))


def _run(argv: list[str], check: bool = True) -> str:
    done = subprocess.run(argv, check=False, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise LabUnavailable(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def check_lab() -> None:
    """Raise `LabUnavailable` unless this process can build a lab (see the module docstring)."""
    missing = [name for name in ("ip", "tc") if shutil.which(name) is None]
    if missing:
        raise LabUnavailable(
            f"{' and '.join(missing)} not found: install iproute2 (apt-get install -y iproute2) to build the network "
            "namespaces this benchmark measures over"
        )
    if os.geteuid() != 0:
        raise LabUnavailable("network namespaces need root (or CAP_NET_ADMIN + CAP_SYS_ADMIN): run as root")
    probe = f"{PREFIX}{os.getpid()}-probe"
    done = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        raise LabUnavailable(
            f"cannot create a network namespace (`ip netns add` said: {done.stderr.strip()}): this container lacks "
            "CAP_SYS_ADMIN; run on a machine or container that allows `ip netns add` (docker: --privileged)"
        )
    _run(["ip", "netns", "del", probe], check=False)


def remove_leftovers(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces and links named `prefix<pid>...` whose pid is dead (a lab a crash left); returns them."""
    owned = re.compile(rf"^{re.escape(prefix)}(\d+)")
    removed = []
    for kind, names in (("netns", namespace_names()), ("link", link_names())):
        for name in names:
            match = owned.match(name)
            if match and not pid_alive(int(match.group(1))):
                _run(["ip", kind, "del", name], check=False)
                removed.append(name)
    return removed


def namespace_names() -> list[str]:
    """The named network namespaces (`ip netns list`)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"], check=False).splitlines() if line.split()]


def link_names() -> list[str]:
    """The links of this process's network namespace (`ip -o link show`, without the `@peer` suffix)."""
    lines = _run(["ip", "-o", "link", "show"], check=False).splitlines()
    return [line.split(": ")[1].split("@")[0] for line in lines if len(line.split(": ")) > 1]


def token_bucket(rate_mbit: float) -> list[str]:
    """tc arguments of a token bucket at `rate_mbit`: a burst of at least 256 KiB (a few GSO segments, and over
    the rate's share of a 4 ms timer tick) and at most 50 ms of queue before it drops (TCP then slows down)."""
    burst = max(256 << 10, int(rate_mbit * 1e6 / 8 / 250))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms"]


@contextmanager
def lab(hosts: int, rate_mbit: float, prefix: str = PREFIX) -> Iterator[Lab]:
    """Build the lab (see the module docstring), yield it, remove it whatever happens."""
    if not 1 <= hosts <= MAX_HOSTS:
        raise ValueError(f"hosts must be in 1..{MAX_HOSTS} (got {hosts})")
    if rate_mbit <= 0:
        raise ValueError(f"rate_mbit must be > 0 (got {rate_mbit})")
    check_lab()
    remove_leftovers(prefix)
    tag = f"{prefix}{os.getpid()}"
    built = Lab(tag, [f"{tag}-h{i}" for i in range(hosts)], [f"{SUBNET}.{i + 1}" for i in range(hosts)], [], rate_mbit)
    bridge_ns = f"{tag}-br"
    atexit.register(_remove, tag, bridge_ns, built.namespaces)
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
    try:
        _build(built, bridge_ns)
        yield built
    finally:
        _remove(tag, bridge_ns, built.namespaces)
        atexit.unregister(_remove)
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _build(built: Lab, bridge_ns: str) -> None:
    _run(["ip", "netns", "add", bridge_ns])
    _run(["ip", "-n", bridge_ns, "link", "add", BRIDGE, "type", "bridge"])
    _run(["ip", "-n", bridge_ns, "link", "set", BRIDGE, "up"])
    shape = token_bucket(built.rate_mbit)
    for index, (namespace, address) in enumerate(zip(built.namespaces, built.hosts)):
        host_end, bridge_end = f"{built.prefix}h{index}", f"{built.prefix}b{index}"
        _run(["ip", "netns", "add", namespace])
        _run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", bridge_end])
        _run(["ip", "link", "set", host_end, "netns", namespace])
        _run(["ip", "link", "set", bridge_end, "netns", bridge_ns])
        _run(["ip", "-n", bridge_ns, "link", "set", bridge_end, "master", BRIDGE, "up"])
        _run(["ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", host_end])
        _run(["ip", "-n", namespace, "link", "set", host_end, "up"])
        _run(["ip", "-n", namespace, "link", "set", "lo", "up"])
        _run(["tc", "-n", namespace, "qdisc", "add", "dev", host_end, "root", *shape])
        _run(["tc", "-n", bridge_ns, "qdisc", "add", "dev", bridge_end, "root", *shape])
        built.links.append(host_end)


def _remove(tag: str, bridge_ns: str, namespaces: list[str]) -> None:
    """Delete the lab's namespaces (their veth ends go with them) and any link of it left in this namespace."""
    present = set(namespace_names())
    for namespace in [*namespaces, bridge_ns]:
        if namespace in present:
            _run(["ip", "netns", "del", namespace], check=False)
    for name in link_names():
        if re.match(rf"^{re.escape(tag)}\D", name):  # this lab's, not those of a pid that starts with the same digits
            _run(["ip", "link", "del", name], check=False)
