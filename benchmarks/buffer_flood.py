"""The buffer's memory and push latency under a flood of big groups (issue 12, item 6: memory per group).

    .venv/bin/python -m benchmarks.buffer_flood [--tokens 16384 1008] [--groups 600] [--persist]
    git archive c6e4337 | tar -x -C /tmp/before && cp benchmarks/buffer_flood.py /tmp/before/benchmarks/ &&
        (cd /tmp/before && /work/main/.venv/bin/python -m benchmarks.buffer_flood)     # the buffer before issue 12

Starts `tandem buffer` of the checkout it runs in (default config: capacity 4096 samples, algo.group_size 8,
model.max_model_len 1024; buffer.persist as `--persist` says), leases prompts as one generator and pushes `--groups` groups of 8 samples x `--tokens` completion tokens after a 16-token prompt, each
waiting for its ack. Prints the acks by status, the push round trip (median, p90, max over the last half, when the
buffer holds all it will hold) and the buffer's resident memory (VmRSS) at start and after the flood. The largest
group the fixed buffer accepts has 8 x (1024 - 16) tokens: `--tokens 1008`.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import save
from common.sockets import Client, SocketSecurity
from common.types import GroupAck, LeaseGrant, LeaseRequest, RolloutGroup, StatsRequest
from launch.testing import RoleUnderTest, run_config

PROMPT_TOKENS, GROUP_SIZE = 16, 8


def flood_group(lease_id: int, prompt_id: int, epoch: int, tokens: int, seed: int) -> RolloutGroup:
    """A valid group (ids < 49152, log-probs <= 0) of GROUP_SIZE samples x `tokens` tokens."""
    rng = np.random.default_rng(seed)
    total = GROUP_SIZE * tokens
    return RolloutGroup(
        lease_id=lease_id,
        prompt_id=prompt_id,
        epoch=epoch,
        generator_id=0,
        prompt_tokens=rng.integers(0, 49152, PROMPT_TOKENS).astype(np.int32),
        offsets=np.arange(0, total + 1, tokens, dtype=np.int64),
        completion_tokens=rng.integers(0, 49152, total).astype(np.int32),
        behaviour_logprobs=-rng.random(total).astype(np.float32),
        loss_mask=np.ones(total, np.uint8),
        token_versions=np.zeros(total, np.int32),
        versions=np.zeros(GROUP_SIZE, np.int32),
        rewards=rng.random(GROUP_SIZE).astype(np.float32),
        finish_reasons=["length"] * GROUP_SIZE,
    )


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def flood(workdir: Path, tokens: int, groups: int, persist: bool) -> dict[str, float | int | dict[str, int]]:
    config = run_config(
        workdir,
        "flood",
        buffer={"lease_timeout_s": 3600.0, "heartbeat_timeout_s": 3600.0, "persist": persist},
        algo={"group_size": GROUP_SIZE, "max_staleness": 100000},
        env={"num_prompts": 4096},
    )
    buffer = RoleUnderTest(config, "buffer").start()
    # a generator's role (checkouts before per-role identities have no `role`: their buffer takes anyone's groups)
    role = {"role": "generator"} if "role" in inspect.signature(Client).parameters else {}
    client = Client(config.generator.buffer_address, SocketSecurity(), identity="flood", **role)
    try:
        client.request(StatsRequest(), timeout_s=60)
        time.sleep(1.0)
        start_rss = rss_mb(buffer.pid)
        acks: dict[str, int] = {}
        latencies: list[float] = []
        while len(latencies) < groups:
            grant, _ = client.request(LeaseRequest(0, 16, 0), timeout_s=30)
            assert isinstance(grant, LeaseGrant), grant
            for prompt in grant.prompts[: groups - len(latencies)]:
                group = flood_group(grant.lease_id, prompt.prompt_id, prompt.epoch, tokens, len(latencies))
                began = time.perf_counter()
                ack, _ = client.request(group, timeout_s=60)
                latencies.append(time.perf_counter() - began)
                status = ack.status if isinstance(ack, GroupAck) else type(ack).__name__
                acks[status] = acks.get(status, 0) + 1
        counters = client.request(StatsRequest(), timeout_s=30)[0].counters
        last = sorted(latencies[len(latencies) // 2 :])
        return {
            "persist": persist,
            "tokens_per_sample": tokens,
            "groups": groups,
            "acks": acks,
            "buffered_groups": counters["buffered_groups"],
            "push_ms_median": 1e3 * statistics.median(last),
            "push_ms_p90": 1e3 * last[int(0.9 * (len(last) - 1))],
            "push_ms_max": 1e3 * last[-1],
            "rss_mb_start": start_rss,
            "rss_mb_end": rss_mb(buffer.pid),
        }
    finally:
        client.close()
        buffer.kill()


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures issue 12 quotes, per flood (`tokens_per_sample`): the buffer's memory before and after, the push
    round trip, and how many groups it holds."""
    figures: dict[str, Any] = {}
    for run in result["runs"]:
        tag = f"{run['tokens_per_sample']}_tokens"
        for key in ("buffered_groups", "rss_mb_start", "rss_mb_end", "push_ms_median", "push_ms_max"):
            figures[f"{key}_{tag}"] = run[key]
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[16384, 1008],
        help="completion tokens per sample, one flood each (1008: the largest group the buffer accepts)",
    )
    parser.add_argument("--groups", type=int, default=600, help="groups pushed")
    parser.add_argument("--persist", action="store_true", help="journal every group (buffer.persist = true)")
    args = parser.parse_args(argv)
    runs = []
    for tokens in args.tokens:
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(flood(Path(tmp), tokens, args.groups, args.persist))
        print(f"{Path(__file__).resolve().parents[1]}: {runs[-1]}")
    result = {"runs": runs}
    save("buffer_flood", {"headline": headline(result), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
