r"""The broadcast transport's rounds (weights.transport = "broadcast", gloo on CPU, real processes): what a round
costs, what a generator joining costs, and whether a slow generator holds anyone back. <= 2 min on 2 cores.

    python -m benchmarks.broadcast_rounds [--mb 64] [--rounds 4]

Learner rank 0's `BroadcastWeightsPublisher` runs in this process; each generator is a process of its own that does
what a generator's weights path does (`BroadcastWeightsSource.fetch`, `seal`, then its one worker joins the round's
group and receives it with `common.broadcast.receive_round`), without vLLM: the figures are the transport's.

Three phases, one run:
  1. steady: generators 0 and 1 take `--rounds` rounds of a `--mb` MB model. Per round: the seconds `publish`
     blocked the training thread (`publish_block_s`: the copy into the round's buckets), the round's wall time
     from `publish` to the last member holding it (`round_s`), and the bytes rank 0 sent (once per round,
     whatever the fleet).
  2. join: generator 2 starts; the next round forms a new group with it (`join_epoch_form_s`, and that round's
     `round_s`).
  3. slow member: generator 1 becomes ready `SLOW_S` after each announcement (a long drain), longer than
     broadcast_ready_timeout_s: the round goes to the others after the ready timeout, and the slow one takes the
     next. `slow_publish_block_s`: what the training thread waited then (the claim: no more than in phase 1).

Writes benchmarks/results/broadcast_rounds.json (headline: publish_block_s, round_s, join_epoch_form_s,
slow_round_s, slow_publish_block_s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save

READY_TIMEOUT_S = 2.0  # the slow phase's rounds wait this long for the slow generator, then go on without it
SLOW_S = 3.0  # > READY_TIMEOUT_S: the slow generator misses every round of phase 3
RUN_S = 300.0  # every process gives up after this


def weights_config(group_port: int) -> Any:
    from common.config import WeightsConfig

    return WeightsConfig(
        transport="broadcast",
        broadcast_backend="gloo",
        broadcast_port=group_port,
        broadcast_timeout_s=30.0,
        broadcast_join_timeout_s=30.0,
        broadcast_ready_timeout_s=READY_TIMEOUT_S,
    )


def model_weights(mb: int, version: int) -> list[tuple[str, Any]]:
    """`mb` MB of bfloat16 in 8 layers of 4 tensors (a fresh value per version: rounds carry new bytes)."""
    import torch

    per_tensor = mb * (1 << 20) // 2 // 32
    return [
        (f"model.layers.{layer}.w{i}", torch.full((per_tensor,), float(version), dtype=torch.bfloat16))
        for layer in range(8)
        for i in range(4)
    ]


def run_member(doorbell: int, group: int, index: int, out: Path, slow_from: int) -> None:
    """A generator's weights path (see the module docstring): writes out/g{index}.json, {version: time held}."""
    from actors.weights.broadcast_source import BroadcastRound, BroadcastWeightsSource
    from actors.weights.updates import WeightsRejected
    from common.broadcast import BroadcastGroup, receive_round
    from common.sockets import SocketSecurity

    source = BroadcastWeightsSource(f"127.0.0.1:{doorbell}", SocketSecurity(), index, 1, weights_config(group))
    group_of: dict[int, Any] = {}
    held: dict[int, float] = {}
    have, deadline = 0, time.monotonic() + RUN_S
    while time.monotonic() < deadline and not (out / "stop").exists():
        update = source.fetch(have)
        if not isinstance(update, BroadcastRound):
            time.sleep(0.01)
            continue
        if 0 <= slow_from <= update.policy_version:
            time.sleep(SLOW_S)  # a long drain before this generator can take the round
        try:
            ticket = source.seal(update.header)
        except WeightsRejected:
            continue  # the round went without it: the next one is its
        if ticket.epoch not in group_of:
            for old in group_of.values():
                old.close()
            group_of = {ticket.epoch: BroadcastGroup.open(
                ticket.host, ticket.port, ticket.rank_offset, ticket.world_size, "gloo", ticket.timeout_s,
                ticket.join_timeout_s,
            )}  # fmt: skip
        receive_round(group_of[ticket.epoch], update.header, lambda i, bucket: None)
        have = update.policy_version
        held[have] = time.time()
        (out / f"g{index}.tmp").write_text(json.dumps(held))
        (out / f"g{index}.tmp").replace(out / f"g{index}.json")  # whole, for the reader polling it
    source.close()


def _start(doorbell: int, group: int, index: int, out: Path, slow_from: int = -1) -> subprocess.Popen:
    argv = [sys.executable, "-m", "benchmarks.broadcast_rounds", "member", str(doorbell), str(group), str(index)]
    return subprocess.Popen([*argv, str(out), str(slow_from)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _held(out: Path, index: int) -> dict[int, float]:
    path = out / f"g{index}.json"
    return {int(v): t for v, t in json.loads(path.read_text()).items()} if path.exists() else {}


def _round(publisher: Any, version: int, mb: int, out: Path, members: list[int]) -> dict[str, float]:
    """Publish `version` and wait until every one of `members` holds it."""
    weights = model_weights(mb, version)
    layout = [(name, "bfloat16", list(t.shape)) for name, t in weights]
    started = time.time()
    blocked = publisher.publish(version, layout, iter(weights))
    deadline = time.monotonic() + RUN_S
    while not all(version in _held(out, m) for m in members):
        if time.monotonic() > deadline:
            raise TimeoutError(f"round v{version} never reached generators {members}")
        time.sleep(0.01)
    return {"publish_block_s": blocked, "round_s": max(_held(out, m)[version] for m in members) - started}


def measure(mb: int, rounds: int) -> dict[str, Any]:
    from common.sockets import SocketSecurity, free_port
    from learners.broadcast_publisher import BroadcastWeightsPublisher

    doorbell, group = free_port(), free_port()
    publisher = BroadcastWeightsPublisher("127.0.0.1", doorbell, SocketSecurity(), weights_config(group))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        slow_from = 2 * rounds + 2  # generator 1 turns slow from the first round of phase 3
        members = [_start(doorbell, group, 0, out), _start(doorbell, group, 1, out, slow_from)]
        try:
            time.sleep(3.0)  # both have asked the doorbell once: the first round waits for both
            steady = [_round(publisher, v, mb, out, [0, 1]) for v in range(1, rounds + 1)]
            forms_before = len(publisher.epoch_form_s)
            members.append(_start(doorbell, group, 2, out))
            time.sleep(3.0)
            joined = _round(publisher, rounds + 1, mb, out, [0, 1, 2])
            join_form_s = publisher.epoch_form_s[forms_before:]
            slow = [_round(publisher, v, mb, out, [0, 2]) for v in range(slow_from, slow_from + 2)]
            counters = dict(publisher.counters)
        finally:
            (out / "stop").write_text("")
            for process in members:
                process.wait(timeout=60)
            publisher.close()
    return {
        "mb": mb,
        "ready_timeout_s": READY_TIMEOUT_S,
        "slow_s": SLOW_S,
        "steady": steady,
        "joined": joined,
        "join_epoch_form_s": join_form_s,
        "slow": slow,
        "counters": counters,
    }


def headline(result: dict[str, Any]) -> dict[str, float]:
    steady, slow = result["steady"][1:], result["slow"]  # the first steady round also forms the group
    return {
        "publish_block_s": statistics.median(r["publish_block_s"] for r in steady),
        "round_s": statistics.median(r["round_s"] for r in steady),
        "join_epoch_form_s": max(result["join_epoch_form_s"], default=0.0),
        "slow_round_s": statistics.median(r["round_s"] for r in slow),
        "slow_publish_block_s": statistics.median(r["publish_block_s"] for r in slow),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "member":
        doorbell, group, index = (int(a) for a in sys.argv[2:5])
        run_member(doorbell, group, index, Path(sys.argv[5]), int(sys.argv[6]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="model size in MB (bfloat16)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the steady phase")
    args = parser.parse_args()
    result = measure(args.mb, args.rounds)
    result["headline"] = headline(result)
    print(json.dumps(result["headline"], indent=2))
    save("broadcast_rounds", result)


if __name__ == "__main__":
    main()
