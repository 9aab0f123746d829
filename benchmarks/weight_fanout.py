"""Weights fan-out over a network: bytes out of the publisher and publish -> every generator holds it, star vs relay.

    flock /tmp/tandem-heavy.lock .venv/bin/python -m benchmarks.weight_fanout                 # ~10 min, as root
    flock /tmp/tandem-heavy.lock .venv/bin/python -m benchmarks.weight_fanout --quick         # ~10 s (smoke test)
    .venv/bin/python -m benchmarks.weight_fanout --rate-mbit 200 --weights-mib 256 --generators 1,2,4,8,16
    .venv/bin/python -m benchmarks.weight_fanout --transports relay --fanout 1 --generators 1,16 --out weight_fanout_k1

The network: `benchmarks.netns.lab` builds G + 1 hosts, each a network namespace with one link onto a bridge, capped
at `--rate-mbit` in each direction by `tc` token buckets (addresses in 10.213.0.0/24, only inside the namespaces;
all removed at the end). Host 0 runs the publisher, hosts 1..G one simulated generator each (its own host id, so
no two share a host copy). Every process is a real role's code over real TCP sockets: the publisher is
`learners.publisher.open_weights_publisher(config.weights, ...)`, each generator runs
`actors.weights.updates.open_weights_source(...)` and its `fetch(have_version)` loop, as the generator's poller does, and
nothing else (no vLLM: what is measured is the transport). The sockets bind the namespaces' private addresses
without keys: `run.insecure = true` (SocketSecurity(insecure=True)), fine on a network nothing else can reach.

Per point (transport, G): fresh processes, `--updates` measured updates (2; the star `--star-updates` 1, since it
sends G copies through one capped link, slow by design; `--warmup` N unmeasured ones first: a first update took
as long as the next in trials, 31.51 s vs 31.54 s for the relay at G = 16, so none by default).
weights.stall_timeout_s is raised where the link rate needs it (`stall_timeout_for`). Per update v:
  published    time.time() when `publish(v)` returned in the publisher (its snapshot is served from then)
  held         time.time() when `fetch` returned v in a generator (the whole update, checked by the source)
  latency_s    max over generators of held - published (one clock: every namespace shares the machine's)
  publisher_bytes       the publisher's own count of bytes it sent of v (`bytes_by_version[v]`)
  publisher_link_bytes  what its link's kernel counter saw leave host 0 meanwhile (with TCP/IP headers, requests)
  cpu_busy     the machine's busy share of all cores over publish -> all held (/proc/stat; softirq is the network)
After every update each generator reports the sha256 of the tensors it holds (layout order, exact bytes), against
the publisher's of the arrays it published: `all_bytes_matched` says no generator got wrong bytes. Each row
reports the median over measured updates. Targets (issue 13): publisher_bytes <= k x model_bytes at every G
(k = weights.fanout), and, over the capped links, latency at the largest G <= 2 x latency at G = 1.
Writes results/weight_fanout.{json,png}; exits 1 if a generator held wrong bytes, 2 if no lab can be built here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import mmap
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import save
from benchmarks.netns import Lab, LabUnavailable, lab
from common.processes import pid_alive

WORK_PREFIX = "weight-fanout-"  # + the driver's pid: its directories under /tmp and /dev/shm
PORT = 5555  # inside host 0's namespace: nothing else binds there
TRANSPORTS = ("star", "relay")
FULL_GENERATORS = (1, 2, 4, 8, 16)
# Each link's cap: slow enough that 16 relaying generators on two cores do not only measure the CPU (at 320 Mbit/s
# the cores were 90% busy at G = 16, at 160 Mbit/s 42%), fast enough that the star's 1 + 2 + 4 + 8 + 16 copies
# through one link take under 6 min.
DEFAULT_RATE_MBIT = 200.0
QUICK_GENERATORS = (1, 4)

Layout = list[tuple[str, str, list[int]]]


# ------------------------------------------------------------------------------------------------ the model's bytes
def model_layout(target_bytes: int) -> Layout:
    """A Llama-shaped layout of about `target_bytes`: tied bf16 embeddings (a quarter of it), then layers of bf16
    attention and MLP matrices with float32 norms, as a Hugging Face state dict names them."""
    hidden = max(64, 64 * round(math.sqrt(target_bytes / 256) / 64))  # vocab 32 x hidden, 2 bytes: 1/4 of the bytes
    vocab, inter = 32 * hidden, max(256, 256 * round(2.75 * hidden / 256))
    layer_bytes = 2 * (4 * hidden * hidden + 3 * hidden * inter) + 4 * 2 * hidden
    layers = max(1, round((target_bytes - 2 * vocab * hidden) / layer_bytes))
    layout: Layout = [("model.embed_tokens.weight", "bfloat16", [vocab, hidden])]
    for i in range(layers):
        prefix = f"model.layers.{i}"
        layout += [(f"{prefix}.input_layernorm.weight", "float32", [hidden])]
        layout += [(f"{prefix}.self_attn.{p}_proj.weight", "bfloat16", [hidden, hidden]) for p in "qkvo"]
        layout += [(f"{prefix}.post_attention_layernorm.weight", "float32", [hidden])]
        layout += [(f"{prefix}.mlp.{p}_proj.weight", "bfloat16", [inter, hidden]) for p in ("gate", "up")]
        layout += [(f"{prefix}.mlp.down_proj.weight", "bfloat16", [hidden, inter])]
    return layout + [("model.norm.weight", "float32", [hidden])]


def layout_bytes(layout: Layout) -> int:
    itemsize = {"bfloat16": 2, "float32": 4}
    return sum(math.prod(shape) * itemsize[dtype] for _, dtype, shape in layout)


def version_arrays(layout: Layout, version: int) -> list[tuple[str, np.ndarray]]:
    """Different random bytes for every version (bf16 as its raw 16-bit words), the same in every process."""
    rng = np.random.default_rng(version)
    storage = {"bfloat16": np.uint16, "float32": np.float32}
    arrays = []
    for name, dtype, shape in layout:
        words = np.frombuffer(rng.bytes(math.prod(shape) * np.dtype(storage[dtype]).itemsize), storage[dtype])
        arrays.append((name, words.reshape(shape)))
    return arrays


def arrays_digest(arrays: list[tuple[str, np.ndarray]]) -> str:
    digest = hashlib.sha256()
    for _, array in arrays:
        digest.update(memoryview(np.ascontiguousarray(array)).cast("B"))
    return digest.hexdigest()


def update_digest(update: Any) -> str:
    """sha256 of an update's tensors in header order, exact bytes: from its buckets, or from the shared-memory file
    its `staged` names when it came as a host copy (the same bytes either way)."""
    digest = hashlib.sha256()
    if update.staged is not None:
        path, tensors = update.staged
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            for _, _, _, offset, nbytes in tensors:
                digest.update(mapped[offset : offset + nbytes])
        return digest.hexdigest()
    for spec in update.header.tensors:
        digest.update(update.buckets[spec.bucket][spec.offset : spec.offset + spec.nbytes])
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------ the roles' processes
def emit(event: str, **fields: Any) -> None:
    """One JSON line on stdout: how a role reports to the driver (logs go to stderr), with the CPU seconds (user +
    system, all threads) this process has used so far."""
    cpu_s = sum(os.times()[:2])
    print(json.dumps({"event": event, "cpu_s": cpu_s, **fields}), flush=True)


def weights_config(args: argparse.Namespace, relay_host: str = "127.0.0.1", host_id: str = "") -> Any:
    from common.config import WeightsConfig

    return WeightsConfig(
        transport=args.transport,
        fanout=args.fanout,
        relay_host=relay_host,
        host_id=host_id,
        stall_timeout_s=args.stall_timeout_s,
        chunk_mb=args.chunk_mb,
        relay_fanout=args.relay_fanout,
    )


def stall_timeout_for(rate_mbit: float, fanout: int) -> float:
    """weights.stall_timeout_s that a link of `rate_mbit` needs: the relay times each chunk reply (up to
    `actors.weights.relay.MAX_REPLY_BYTES`) against it, and the publisher's uplink carries `fanout` such replies at once;
    twice that time, and never below the default. Under it, every direct child of the publisher would be judged
    stalled on slow links (at the default 5 s: below ~215 Mbit/s for k = 2) and no update would complete."""
    from actors.weights.relay import MAX_REPLY_BYTES
    from common.config import WeightsConfig

    default = WeightsConfig.model_fields["stall_timeout_s"].default
    return max(default, 2 * fanout * MAX_REPLY_BYTES / (rate_mbit * 1e6 / 8))


def run_publisher(args: argparse.Namespace) -> None:
    """Host 0: publish each version the driver asks for (`prepare V`, `publish V`), report its bytes (`stats V`)."""
    from common.sockets import SocketSecurity
    from learners.publisher import open_weights_publisher

    publisher = open_weights_publisher(weights_config(args), args.host, PORT, SocketSecurity(insecure=True))
    if hasattr(publisher, "reader_deadline_s"):  # star: G x the model through one capped link takes that long
        publisher.reader_deadline_s = max(publisher.reader_deadline_s, args.deadline_s)
    layout = model_layout(args.weights_bytes)
    emit("ready", model_bytes=layout_bytes(layout), tensors=len(layout))
    arrays: list[tuple[str, np.ndarray]] = []
    for line in sys.stdin:
        command, _, value = line.strip().partition(" ")
        if command == "prepare":
            arrays = version_arrays(layout, int(value))
            emit("prepared", version=int(value), digest=arrays_digest(arrays))
        elif command == "publish":
            blocked_s = publisher.publish(int(value), layout, iter(arrays))
            emit("published", version=int(value), at=time.time(), publish_s=blocked_s)
        elif command == "stats":
            counters = dict(publisher.counters)
            sent = getattr(publisher, "bytes_by_version", {}).get(int(value), counters.get("served_bytes", 0))
            emit("stats", version=int(value), bytes=sent, counters=counters)
        elif command == "exit":
            break
    publisher.close()


def run_generator(args: argparse.Namespace) -> None:
    """Host i: fetch every newer version as a generator's poller does; `verify V` reports the held bytes' digest."""
    from actors.weights.updates import open_weights_source
    from common.sockets import SocketSecurity

    config = weights_config(args, relay_host=args.host, host_id=f"weight-fanout-host-{args.index}")
    security = SocketSecurity(insecure=True)
    source = open_weights_source(config, f"{args.publisher}:{PORT}", security, args.index, Path(args.store_dir))
    if hasattr(source, "timeout_s"):  # star: the reply takes as long as the publisher's link needs for G copies
        source.timeout_s = max(source.timeout_s, args.deadline_s)
    held: dict[int, Any] = {}
    threading.Thread(target=_fetch_forever, args=(source, held), name="fetch", daemon=True).start()
    emit("ready")
    for line in sys.stdin:
        command, _, value = line.strip().partition(" ")
        if command == "verify":
            update = held[int(value)]
            emit("verified", version=int(value), digest=update_digest(update))
        elif command == "exit":
            break
    emit("counters", counters=_source_counters(source))
    os._exit(0)  # the fetch thread may be inside a long poll: end without waiting (the driver removes the store)


def _fetch_forever(source: Any, held: dict[int, Any]) -> None:
    have = -1
    while True:
        started = time.time()
        result = source.fetch(have)
        if not isinstance(result, int):
            at = time.time()
            held.clear()
            held[result.policy_version] = result
            have = result.policy_version
            header = result.header
            emit(
                "held",
                version=have,
                at=at,
                fetch_s=at - started,
                depth=getattr(header, "depth", 0),
                parent=getattr(header, "parent", ""),
                host_copy=result.staged is not None,
                source_receive=getattr(source, "last_receive", {}),
            )
        elif result >= have:
            time.sleep(0.02)  # a source that does not long-poll: ask again shortly


def _source_counters(source: Any) -> dict[str, Any]:
    counters = {}
    for name in ("counters", "failures", "stats"):
        value = getattr(source, name, None)
        if isinstance(value, dict):
            counters.update({f"{name}/{k}": v for k, v in value.items()})
    return counters


# ------------------------------------------------------------------------------------------------ the driver
class Role:
    """One role process in a host's namespace: commands on its stdin, its JSON lines read by a thread."""

    def __init__(self, net: Lab, index: int, argv: list[str], log_dir: Path) -> None:
        self.name = "publisher" if index == 0 else f"generator {index}"
        self.log_path = log_dir / f"host{index}.log"
        command = net.exec_argv(index, [sys.executable, "-m", "benchmarks.weight_fanout", *argv])
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, cwd=_ROOT
            )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.cpu_s = 0.0  # its CPU seconds at the end of the last update (the driver sets it)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def send(self, command: str) -> None:
        try:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            self.process.wait()
            tail = self.log_path.read_text()[-2000:]
            raise RuntimeError(
                f"{self.name} exited {self.process.returncode} before '{command}'; log:\n{tail}"
            ) from None

    def expect(self, event: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    tail = self.log_path.read_text()[-2000:]
                    state = f"exited {self.process.returncode}" if self.process.poll() is not None else "running"
                    raise TimeoutError(f"{self.name}: no '{event}' within {timeout_s:.0f}s ({state}); log:\n{tail}")
                continue
            if line["event"] == event:
                return line

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.send("exit")
                self.process.wait(timeout=10)
            except (OSError, RuntimeError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


_ROOT = Path(__file__).resolve().parents[1]


def cpu_times() -> tuple[int, int, int]:
    """(busy, softirq, total) jiffies of all cores since boot (/proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:9]]
    idle, iowait, softirq = fields[3], fields[4], fields[6]  # user nice system idle iowait irq softirq steal
    return sum(fields) - idle - iowait, softirq, sum(fields)


@dataclass
class Workspace:
    """The driver's directories: role logs (kept when the run fails), and the generators' host-copy stores in
    shared memory (removed after every point: 16 generators hold ~4 GB there at 256 MB)."""

    logs: Path
    stores: Path


@contextmanager
def workspace() -> Iterator[Workspace]:
    """Make the directories (after removing those a killed driver left: named with a pid no longer alive)."""
    from actors.weights.updates import shared_memory_dir

    roots = [Path(tempfile.gettempdir()), shared_memory_dir()]
    for root in roots:
        for old in root.glob(f"{WORK_PREFIX}*"):
            pid = old.name.removeprefix(WORK_PREFIX)
            if pid.isdigit() and not pid_alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
    work = Workspace(*(root / f"{WORK_PREFIX}{os.getpid()}" for root in roots))
    work.logs.mkdir(parents=True, exist_ok=True)
    work.stores.mkdir(parents=True, exist_ok=True)
    try:
        yield work
    except BaseException:
        print(f"weight_fanout: the roles' logs are kept in {work.logs}", file=sys.stderr)
        raise
    else:
        shutil.rmtree(work.logs, ignore_errors=True)
    finally:
        shutil.rmtree(work.stores, ignore_errors=True)


def measure_point(net: Lab, transport: str, generators: int, args: argparse.Namespace, work: Workspace) -> dict:
    """Start the publisher and G generators, run the updates, return the point's row (see the module docstring)."""
    stores = work.stores / f"{transport}-G{generators}"
    try:
        return _measure_point(net, transport, generators, args, work.logs, stores)
    finally:
        shutil.rmtree(stores, ignore_errors=True)


def _measure_point(
    net: Lab, transport: str, generators: int, args: argparse.Namespace, log_dir: Path, stores: Path
) -> dict:
    common = ["--transport", transport, "--fanout", str(args.fanout), "--deadline-s", str(args.deadline_s)]
    common += ["--stall-timeout-s", str(args.stall_timeout_s), "--chunk-mb", str(args.chunk_mb)]
    common += ["--relay-fanout", str(args.relay_fanout)]
    warmup, updates = (args.star_warmup, args.star_updates) if transport == "star" else (args.warmup, args.updates)
    publisher = Role(
        net, 0, ["publisher", "--host", net.hosts[0], "--weights-bytes", str(args.weights_bytes), *common], log_dir
    )
    gens: list[Role] = []
    try:
        model_bytes = publisher.expect("ready", 60)["model_bytes"]
        for index in range(1, generators + 1):
            argv = ["generator", "--index", str(index), "--host", net.hosts[index], "--publisher", net.hosts[0]]
            (stores / f"g{index}").mkdir(parents=True)
            argv += ["--store-dir", str(stores / f"g{index}")]
            gens.append(Role(net, index, [*argv, *common], log_dir))
        for gen in gens:
            gen.cpu_s = gen.expect("ready", 60)["cpu_s"]
        link_s = model_bytes / (net.rate_mbit * 1e6 / 8)  # one copy through one capped link
        timeout_s = 60 + 4 * generators * link_s
        runs = [_one_update(net, publisher, gens, version, timeout_s) for version in range(warmup + updates)]
        counters = [gen.expect("counters", 30)["counters"] for gen in _stopped(gens)]
        measured = runs[warmup:]
        row = {
            "G": generators,
            "transport": transport,
            "publisher_bytes": int(np.median([r["publisher_bytes"] for r in measured])),
            "model_bytes": model_bytes,
            "latency_s": float(np.median([r["latency_s"] for r in measured])),
            "bytes_over_model": float(np.median([r["publisher_bytes"] for r in measured])) / model_bytes,
            "link_s": link_s,
            "cpu_busy_max": max(r["cpu_busy"] for r in measured),
            "all_bytes_matched": all(r["bytes_matched"] for r in runs),
            "warmup": warmup,
            "updates": measured,
            "warmup_updates": runs[:warmup],
            "generator_counters": counters,
        }
    finally:
        for role in [*gens, publisher]:
            role.stop()
    print(
        f"{transport:5s} G={generators:2d}: latency {row['latency_s']:.2f}s ({row['latency_s'] / link_s:.2f}x one link"
        f" copy), publisher {row['bytes_over_model']:.2f}x the model, CPU busy <= {row['cpu_busy_max']:.0%}, "
        f"bytes matched {row['all_bytes_matched']}",
        flush=True,
    )
    return row


def _stopped(gens: list[Role]) -> list[Role]:
    for gen in gens:
        gen.send("exit")
    return gens


def _one_update(net: Lab, publisher: Role, gens: list[Role], version: int, timeout_s: float) -> dict[str, Any]:
    publisher.send(f"prepare {version}")
    prepared = publisher.expect("prepared", 120)
    expected = prepared["digest"]
    cpu_before, link_before = cpu_times(), net.tx_bytes(0)
    publisher.send(f"publish {version}")
    published = publisher.expect("published", 120)
    held = [gen.expect("held", timeout_s) for gen in gens]
    receive_cpu_s = [h["cpu_s"] - gen.cpu_s for h, gen in zip(held, gens)]
    cpu_after, link_after = cpu_times(), net.tx_bytes(0)
    publisher.send(f"stats {version}")
    stats = publisher.expect("stats", 30)
    for gen in gens:
        gen.send(f"verify {version}")
    verified = [gen.expect("verified", 120) for gen in gens]
    for gen, line in zip(gens, verified):
        gen.cpu_s = line["cpu_s"]  # the next update's CPU starts after this check
    busy, softirq, total = (after - before for after, before in zip(cpu_after, cpu_before))
    receive_s = [h["at"] - published["at"] for h in held]
    run = {
        "version": version,
        "latency_s": max(receive_s),
        "publisher_bytes": stats["bytes"],
        "publisher_link_bytes": link_after - link_before,
        "publish_s": published["publish_s"],
        "cpu_busy": busy / max(total, 1),
        "cpu_softirq": softirq / max(total, 1),
        "receive_s": receive_s,
        "depth": [h["depth"] for h in held],
        "parents": [h["parent"] for h in held],
        "host_copies": sum(h["host_copy"] for h in held),
        "generator_cpu_s": receive_cpu_s,
        "publisher_cpu_s": stats["cpu_s"] - prepared["cpu_s"],
        "bytes_matched": all(v["digest"] == expected for v in verified) and all(h["version"] == version for h in held),
        "publisher_counters": stats["counters"],
    }
    print(
        f"  v{version}: latency {run['latency_s']:.2f}s, publisher {run['publisher_bytes'] / 1e6:.0f} MB "
        f"(link {run['publisher_link_bytes'] / 1e6:.0f} MB), CPU {run['cpu_busy']:.0%} "
        f"(softirq {run['cpu_softirq']:.0%}; per generator {np.mean(receive_cpu_s):.2f} s, publisher "
        f"{run['publisher_cpu_s']:.2f} s), depth max {max(run['depth'])}, matched {run['bytes_matched']}",
        flush=True,
    )
    return run


# ------------------------------------------------------------------------------------------------ results
def headline(result: dict[str, Any]) -> dict[str, Any]:
    """Per transport: the worst publisher bytes / model bytes (target <= k) and latency at the largest G over
    G = 1 (target <= 2), the CPU's busiest share (near 1 would mean the figure measures CPU, not links); the link
    rate, k, and whether every generator held exactly the publisher's bytes."""
    rows = result["rows"]
    line: dict[str, Any] = {
        "link_rate_mbit": result["link_rate_mbit"],
        "model_bytes": result["model_bytes"],
        "fanout_k": result["fanout_k"],
        "all_bytes_matched": all(row["all_bytes_matched"] for row in rows),
    }
    for transport in sorted({row["transport"] for row in rows}):
        mine = sorted((row for row in rows if row["transport"] == transport), key=lambda row: row["G"])
        worst = max(row["publisher_bytes"] / row["model_bytes"] for row in mine)
        ratio = mine[-1]["latency_s"] / mine[0]["latency_s"]
        line[transport] = {
            "worst_bytes_over_model": round(worst, 3),
            "bytes_target_met": worst <= result["fanout_k"],
            f"latency_ratio_G{mine[-1]['G']}_over_G{mine[0]['G']}": round(ratio, 3),
            "latency_target_met": ratio <= 2.0,
            "latency_s_by_G": {str(row["G"]): round(row["latency_s"], 3) for row in mine},
            "cpu_busy_max": round(max(row["cpu_busy_max"] for row in mine), 3),
        }
    return line


def plot(result: dict[str, Any]) -> Any:
    from benchmarks.common import side_by_side

    def draw(axes: Any) -> None:
        left, right = side_by_side(axes, 2, width=11)
        for transport in sorted({row["transport"] for row in result["rows"]}):
            mine = sorted((r for r in result["rows"] if r["transport"] == transport), key=lambda r: r["G"])
            g = [r["G"] for r in mine]
            left.plot(g, [r["publisher_bytes"] / r["model_bytes"] for r in mine], "o-", label=transport)
            right.plot(g, [r["latency_s"] for r in mine], "o-", label=transport)
        left.axhline(result["fanout_k"], color="r", linestyle=":", label=f"target k = {result['fanout_k']}")
        left.set(xscale="log", yscale="log", xlabel="generators G", ylabel="publisher bytes / model bytes")
        right.set(xscale="log", yscale="log", xlabel="generators G", ylabel="publish -> all hold it (s)")
        first = min(r["latency_s"] for r in result["rows"] if r["G"] == min(x["G"] for x in result["rows"]))
        right.axhline(2 * first, color="r", linestyle=":", label="2 x latency at G = 1")
        for axes_ in (left, right):
            axes_.set_xticks([r["G"] for r in result["rows"]], [str(r["G"]) for r in result["rows"]])
            axes_.legend(fontsize=8)
        rate = result["link_rate_mbit"]
        left.set_title(f"{result['model_bytes'] / 1e6:.0f} MB per update, links {rate:g} Mbit/s")
        right.set_title("latency over the capped links")

    return draw


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", choices=("driver", "publisher", "generator"), default="driver")
    parser.add_argument("--quick", action="store_true", help="16 MiB, G in {1, 4}, 1 update (the smoke test)")
    parser.add_argument("--rate-mbit", type=float, default=None, help="each link's cap per direction (200; quick 400)")
    parser.add_argument("--weights-mib", type=float, default=None, help="model size (256; quick 16)")
    parser.add_argument("--generators", default=None, help="comma-separated G values (1,2,4,8,16; quick 1,4)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--updates", type=int, default=None, help="measured updates per point (2; quick 1)")
    parser.add_argument("--warmup", type=int, default=None, help="relay: unmeasured updates first (0)")
    parser.add_argument("--star-updates", type=int, default=1, help="star: measured updates (G copies each: slow)")
    parser.add_argument("--star-warmup", type=int, default=0, help="star: unmeasured updates first")
    parser.add_argument("--fanout", type=int, default=2, help="weights.fanout (k)")
    parser.add_argument("--deadline-s", type=float, default=600.0, help="star: reply deadline at both ends")
    parser.add_argument("--chunk-mb", type=float, default=4.0, help="weights.chunk_mb")
    parser.add_argument("--relay-fanout", type=int, default=1, help="weights.relay_fanout")
    parser.add_argument("--stall-timeout-s", type=float, default=None, help="weights.stall_timeout_s (by the rate)")
    parser.add_argument("--out", default="weight_fanout", help="results/<out>.json")
    # the roles' own arguments (set by the driver)
    parser.add_argument("--transport", default="relay")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--publisher", default="127.0.0.1")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--weights-bytes", type=int, default=256 << 20)
    parser.add_argument("--store-dir", default="")
    args = parser.parse_args(argv)
    if args.role == "driver":  # the roles get every value from the driver's command line
        _driver_defaults(args)
    return args


def _driver_defaults(args: argparse.Namespace) -> None:
    quick = args.quick
    args.rate_mbit = args.rate_mbit or (400.0 if quick else DEFAULT_RATE_MBIT)
    args.weights_bytes = int((args.weights_mib or (16 if quick else 256)) * (1 << 20))
    listed = args.generators or ",".join(map(str, QUICK_GENERATORS if quick else FULL_GENERATORS))
    args.generators = [int(g) for g in listed.split(",")]
    args.updates = args.updates if args.updates is not None else (1 if quick else 2)
    args.warmup = args.warmup or 0
    if args.stall_timeout_s is None:
        args.stall_timeout_s = stall_timeout_for(args.rate_mbit, args.fanout)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.role == "publisher":
        run_publisher(args)
        return 0
    if args.role == "generator":
        run_generator(args)
        return 0
    transports = [t for t in args.transports.split(",") if t]
    started = time.monotonic()
    rows = []
    try:
        with lab(max(args.generators) + 1, args.rate_mbit) as net, workspace() as work:
            print(
                f"lab: {len(net.hosts)} hosts, links {args.rate_mbit:g} Mbit/s each way, {net.namespaces[0]}...",
                flush=True,
            )
            for transport in transports:
                for generators in args.generators:
                    rows.append(measure_point(net, transport, generators, args, work))
    except LabUnavailable as error:
        print(f"weight_fanout: cannot build the network namespaces: {error}", file=sys.stderr)
        return 2
    result = {
        "link_rate_mbit": args.rate_mbit,
        "model_bytes": rows[0]["model_bytes"],
        "fanout_k": args.fanout,
        "stall_timeout_s": args.stall_timeout_s,
        "chunk_mb": args.chunk_mb,
        "relay_fanout": args.relay_fanout,
        "generators": args.generators,
        "updates": args.updates,
        "warmup": args.warmup,
        "star_updates": args.star_updates,
        "star_warmup": args.star_warmup,
        "wall_s": time.monotonic() - started,
        "rows": rows,
    }
    result = {"headline": headline(result), **result}
    print(json.dumps(result["headline"], indent=2))
    save(args.out, result, plot(result))
    return 0 if result["headline"]["all_bytes_matched"] else 1


if __name__ == "__main__":
    sys.exit(main())
