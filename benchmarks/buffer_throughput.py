"""Throughput and CPU cost of the buffer service over loopback, with the buffer pinned to one core.

    .venv/bin/python -m benchmarks.buffer_throughput [--seconds 8] [--generators 3] [--learner-step-s 10]

The buffer runs as `python -m launch.cli buffer` (all its threads pinned to core 0); fake generators (processes
pinned to the other cores) lease prompts and push synthetic groups of 64 samples x 1,024 tokens, waiting for
each ack; a fake learner pulls batches of `groups_per_step` groups and reports a new version after each.
Phases:
  ingest          generators only (the buffer is full and evicts the oldest group on every arrival)
  ingest+serve    generators and the learner together (every group is ingested once and served once)
  demo groups     ingest+serve with the demo's group size (algo.group_size x generator.max_tokens tokens)
Figures: groups/s and MB/s in and out (from the buffer's own counters), buffer CPU seconds per group
(process CPU time of all its threads / groups ingested) and the ingest rate that implies at 100% of its core
(on a 2-core machine the clients share the other core, so they, not the buffer, may be the limit), and the
buffer's CPU per learner step (groups_per_step groups in and out) as a share of a learner step
(`--learner-step-s`, 10 s on CPU unless measured).
Targets: >= 1 GB/s ingest, < 1 % of a learner step. Writes results/buffer_throughput.{json,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import save
from common.config import TandemConfig
from common.sockets import Client, PeerUnavailable, SocketSecurity
from common.types import (
    Batch,
    BatchRequest,
    LeaseGrant,
    LeaseRequest,
    RolloutGroup,
    StatsRequest,
    VersionReport,
)
from launch.testing import RoleUnderTest, run_config

ROOT = Path(__file__).resolve().parent.parent
SECURITY = SocketSecurity()
BUFFER_CORE = 0
TARGET_MB_S = 1000.0
TARGET_OVERHEAD = 0.01


def synthetic_group(samples: int, tokens: int) -> RolloutGroup:
    rng = np.random.default_rng(0)
    total = samples * tokens
    return RolloutGroup(
        lease_id=0,
        prompt_id=0,
        epoch=0,
        generator_id=0,
        prompt_tokens=rng.integers(0, 49152, 128).astype(np.int32),
        offsets=np.arange(0, total + 1, tokens, dtype=np.int64),
        completion_tokens=rng.integers(0, 49152, total).astype(np.int32),
        behaviour_logprobs=-rng.random(total).astype(np.float32),
        loss_mask=np.ones(total, np.uint8),
        token_versions=np.zeros(total, np.int32),
        versions=np.zeros(samples, np.int32),
        rewards=rng.random(samples).astype(np.float32),
        reward_components={"correct": rng.random(samples).astype(np.float32)},
        finish_reasons=["stop"] * samples,
    )


def group_bytes(group: RolloutGroup) -> int:
    from common.wire import encode

    return sum(memoryview(frame).nbytes for frame in encode(group))


def _other_cores() -> set[int]:
    return (os.sched_getaffinity(0) - {BUFFER_CORE}) or {BUFFER_CORE}


def generator_process(address: str, generator_id: int, samples: int, tokens: int, stop_at: float, out: Any) -> None:
    """Lease 16 prompts at a time and push one group per prompt, each waiting for its ack, until `stop_at`."""
    os.sched_setaffinity(0, _other_cores())
    client = Client(address, SECURITY, identity=f"bench-generator-{generator_id}", role="generator")
    base = synthetic_group(samples, tokens)
    pushed = 0
    while time.time() < stop_at:
        grant, _ = client.request(LeaseRequest(generator_id, 16, 0), timeout_s=10)
        if not isinstance(grant, LeaseGrant):
            time.sleep(0.01)
            continue
        for prompt in grant.prompts:
            group = dataclasses.replace(
                base, lease_id=grant.lease_id, prompt_id=prompt.prompt_id, epoch=prompt.epoch, generator_id=generator_id
            )
            client.request(group, timeout_s=10)
            pushed += 1
    client.close()
    out.put(pushed)


def learner_process(address: str, num_groups: int, stop_at: float, out: Any) -> None:
    """Pull the batch of each step and report the next version, until `stop_at`."""
    os.sched_setaffinity(0, _other_cores())
    client = Client(address, SECURITY, identity="bench-learner", role="learner")
    step = 0
    while time.time() < stop_at:
        try:
            reply, _ = client.request(BatchRequest(step, 0, 1, num_groups, 0.2), timeout_s=5)
        except PeerUnavailable:
            continue
        if isinstance(reply, Batch):
            step += 1
            client.request(VersionReport(step, step), timeout_s=5)
    client.close()
    out.put(step)


class BufferUnderTest:
    """The buffer service in a subprocess, pinned to BUFFER_CORE before it starts (so are all its threads); killed
    on exit."""

    def __init__(self, workdir: Path, samples: int, groups_per_step: int) -> None:
        config = run_config(
            workdir,
            "bench",
            buffer={
                "capacity": samples * 256,  # 256 groups held at most: the ingest phase evicts on every arrival
                "lease_timeout_s": 600.0,
                "heartbeat_timeout_s": 600.0,
            },
            algo={"group_size": samples, "max_staleness": 100000},
            env={"num_prompts": 4096},
            learner={"groups_per_step": groups_per_step},
            model={"max_model_len": 2048},  # the buffer rejects prompt (128) + completion (1,024) beyond it
        )
        self.address = config.generator.buffer_address
        self.role = RoleUnderTest(config, "buffer", cores={BUFFER_CORE}).start()
        self.client = Client(self.address, SECURITY, identity="bench-stats")
        self.stats()  # waits until it answers

    def stats(self) -> dict[str, int]:
        deadline = time.monotonic() + 60
        while True:
            try:
                return self.client.request(StatsRequest(), timeout_s=2)[0].counters
            except PeerUnavailable:
                if time.monotonic() > deadline or self.role.poll() is not None:
                    raise RuntimeError(f"the buffer does not answer (see {self.role.output_path})") from None

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.role.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all threads

    def close(self) -> None:
        self.client.close()
        self.role.kill()


def run_phase(
    name: str, samples: int, tokens: int, groups_per_step: int, generators: int, seconds: float, serve: bool
) -> dict[str, Any]:
    """One fresh buffer, `generators` generator processes (and a learner if `serve`) for `seconds`."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        buffer = BufferUnderTest(Path(tmp), samples, groups_per_step)
        try:
            out = ctx.Queue()
            stop_at = time.time() + seconds + 3.0  # clients run a little longer than the measured window
            procs = [
                ctx.Process(target=generator_process, args=(buffer.address, i, samples, tokens, stop_at, out))
                for i in range(generators)
            ]
            if serve:
                procs.append(ctx.Process(target=learner_process, args=(buffer.address, groups_per_step, stop_at, out)))
            for proc in procs:
                proc.start()
            time.sleep(1.5)  # spawn + warm-up, not measured
            before, cpu_before, t0 = buffer.stats(), buffer.cpu_seconds(), time.perf_counter()
            time.sleep(seconds)
            after, cpu_after, elapsed = buffer.stats(), buffer.cpu_seconds(), time.perf_counter() - t0
            for proc in procs:
                proc.join(timeout=30)
        finally:
            for proc in locals().get("procs", []):
                if proc.is_alive():
                    proc.kill()
            buffer.close()
    size = group_bytes(synthetic_group(samples, tokens))
    groups_in = after["arrived_groups"] - before["arrived_groups"]
    groups_out = after["served_groups"] - before["served_groups"]
    cpu = cpu_after - cpu_before
    result = {
        "phase": name,
        "samples_per_group": samples,
        "tokens_per_sample": tokens,
        "group_bytes": size,
        "seconds": round(elapsed, 3),
        "groups_in": groups_in,
        "groups_out": groups_out,
        "groups_in_per_s": groups_in / elapsed,
        "groups_out_per_s": groups_out / elapsed,
        "mb_in_per_s": groups_in * size / elapsed / 1e6,
        "mb_out_per_s": groups_out * size / elapsed / 1e6,
        "buffer_cpu_s": cpu,
        "buffer_cpu_share": cpu / elapsed,
        "cpu_s_per_group": cpu / max(groups_in, 1),
        "cpu_bound_mb_in_per_s": size / (cpu / max(groups_in, 1)) / 1e6 if cpu else None,  # at 100% of its core
        "evicted_groups": after["evicted_groups"] - before["evicted_groups"],
        "rejected": {k: v for k, v in after.items() if k.startswith("rejected_") and v},
    }
    print(
        f"{name:>14}: in {result['groups_in_per_s']:8.1f} groups/s {result['mb_in_per_s']:8.1f} MB/s | "
        f"out {result['groups_out_per_s']:8.1f} groups/s {result['mb_out_per_s']:8.1f} MB/s | "
        f"buffer CPU {100 * result['buffer_cpu_share']:5.1f}% of a core, "
        f"{1e3 * result['cpu_s_per_group']:.3f} ms per group "
        f"(-> {result['cpu_bound_mb_in_per_s'] or 0:.0f} MB/s at 100% of its core)"
    )
    return result


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures issues quote: ingest MB/s against its target, and the buffer's CPU share of a learner step."""
    summary = result["summary"]
    keys = ("ingest_mb_per_s", "ingest_target_mb_per_s", "overhead_per_step_64x1024", "overhead_per_step_demo")
    return {**{key: summary[key] for key in keys}, "overhead_target": summary["overhead_target"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window of each phase")
    parser.add_argument("--generators", type=int, default=2, help="fake generator processes")
    parser.add_argument("--learner-step-s", type=float, default=10.0, help="learner step time to compare with")
    args = parser.parse_args(argv)
    demo = TandemConfig()  # the demo's sizes: examples/demo.toml when it sets them, else the defaults
    demo_path = ROOT / "examples" / "demo.toml"
    if demo_path.is_file():
        from common.config import load_config

        demo = load_config(demo_path)
    batch = demo.learner.groups_per_step
    phases = [
        run_phase("ingest", 64, 1024, batch, args.generators, args.seconds, serve=False),
        run_phase("ingest+serve", 64, 1024, batch, args.generators, args.seconds, serve=True),
        run_phase(
            "demo groups",
            demo.algo.group_size,
            demo.generator.max_tokens,
            batch,
            args.generators,
            args.seconds,
            serve=True,
        ),
    ]
    ingest, mixed, small = phases
    overhead_big = mixed["cpu_s_per_group"] * batch / args.learner_step_s
    overhead_demo = small["cpu_s_per_group"] * batch / args.learner_step_s
    summary = {
        "ingest_mb_per_s": ingest["mb_in_per_s"],
        "ingest_target_mb_per_s": TARGET_MB_S,
        "ingest_meets_target": ingest["mb_in_per_s"] >= TARGET_MB_S,
        "learner_step_s": args.learner_step_s,
        "groups_per_step": batch,
        "overhead_per_step_64x1024": overhead_big,
        "overhead_per_step_demo": overhead_demo,
        "overhead_target": TARGET_OVERHEAD,
        "overhead_meets_target": max(overhead_big, overhead_demo) < TARGET_OVERHEAD,
        "load_average_at_end": os.getloadavg(),  # the clients share the other core(s) with whatever else runs
    }
    print(
        f"buffer CPU per learner step ({batch} groups in and out) vs a {args.learner_step_s:.0f} s step: "
        f"{100 * overhead_big:.3f}% with 64x1024 groups, {100 * overhead_demo:.4f}% with demo groups "
        f"({demo.algo.group_size}x{demo.generator.max_tokens}); target < {100 * TARGET_OVERHEAD:.0f}%"
    )
    print(
        f"ingest {ingest['mb_in_per_s']:.0f} MB/s vs target {TARGET_MB_S:.0f} MB/s: "
        f"{'met' if summary['ingest_meets_target'] else 'MISSED'}"
    )

    def plot(axes: Any) -> None:
        labels = [f"{p['phase']}\n{p['samples_per_group']}x{p['tokens_per_sample']}" for p in phases]
        x = np.arange(len(phases))
        axes.bar(x - 0.2, [p["mb_in_per_s"] for p in phases], 0.4, label="ingest MB/s")
        axes.bar(x + 0.2, [p["mb_out_per_s"] for p in phases], 0.4, label="serve MB/s")
        axes.axhline(TARGET_MB_S, color="red", linestyle="--", label="target 1 GB/s ingest")
        axes.set_xticks(x, labels)
        axes.set_ylabel("MB/s over loopback (buffer on one core)")
        axes.set_title("Buffer service throughput")
        axes.legend()

    result = {"phases": phases, "summary": summary}
    save("buffer_throughput", {"headline": headline(result), **result}, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
