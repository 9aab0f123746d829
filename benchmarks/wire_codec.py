"""Encode + decode throughput of a realistic rollout group beside a plain memcpy of the same bytes.

    .venv/bin/python -m benchmarks.wire_codec [--samples 64] [--tokens 1024]

A group of 64 samples x 1,024 completion tokens (plus prompt, log-probs, mask, versions, rewards) is
  - encoded and decoded in-process (zero-copy: arrays become frames, frames become read-only views);
  - encoded, joined into one contiguous buffer (what a socket write does), and decoded;
  - sent through a real ZeroMQ loopback socket (DEALER -> ROUTER), decoded on the other side;
and compared with np.copyto of a buffer of the same size (the memcpy). Target: within 3x of the copy.
"""

from __future__ import annotations

import argparse
import threading
from typing import Any

import numpy as np
import zmq

from benchmarks.common import best_seconds, save
from common.types import RolloutGroup
from common.wire import decode, encode


def make_group(samples: int, tokens: int, seed: int = 0) -> RolloutGroup:
    rng = np.random.default_rng(seed)
    total = samples * tokens
    return RolloutGroup(
        lease_id=1,
        prompt_id=7,
        epoch=0,
        generator_id=0,
        prompt_tokens=rng.integers(0, 49152, 128).astype(np.int32),
        offsets=np.arange(0, total + 1, tokens, dtype=np.int64),
        completion_tokens=rng.integers(0, 49152, total).astype(np.int32),
        behaviour_logprobs=-rng.random(total).astype(np.float32),
        loss_mask=np.ones(total, np.uint8),
        token_versions=np.full(total, 3, np.int32),
        versions=np.full(samples, 3, np.int32),
        rewards=rng.random(samples).astype(np.float32),
        reward_components={"correct": rng.random(samples).astype(np.float32)},
        finish_reasons=["stop"] * samples,
    )


def socket_round(group: RolloutGroup, rounds: int) -> float:
    """Seconds per group sent DEALER -> ROUTER over loopback TCP and decoded on the receiving side."""
    import time

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    frames = encode(group)

    def send() -> None:
        for _ in range(rounds):
            dealer.send_multipart(frames, copy=False)

    received = []
    sender = threading.Thread(target=send)
    start = time.perf_counter()
    sender.start()
    for _ in range(rounds):
        parts = router.recv_multipart(copy=False)
        received.append(decode(parts[1:])[0].size)
    elapsed = time.perf_counter() - start
    sender.join()
    dealer.close(linger=0)
    router.close(linger=0)
    assert all(n == group.size for n in received)
    return elapsed / rounds


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures issues quote: each codec path over a memcpy of the same bytes (target: copy path <= 3x)."""
    ratios = result["ratio_to_memcpy"]
    return {
        "bytes": result["bytes"],
        "zero_copy_over_memcpy": ratios["encode+decode (zero-copy)"],
        "copy_path_over_memcpy": ratios["encode+copy+decode"],
        "loopback_over_memcpy": ratios["zmq loopback + decode"],
        "target_ratio": result["target_ratio"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()

    group = make_group(args.samples, args.tokens)
    nbytes = sum(memoryview(f).nbytes for f in encode(group))
    source, target = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    memcpy_s = best_seconds(lambda: np.copyto(target, source))
    zero_copy_s = best_seconds(lambda: decode(encode(group)))
    joined_s = best_seconds(lambda: decode([bytes(f) for f in encode(group)]))
    socket_s = socket_round(group, rounds=200)

    rows = {
        "memcpy": memcpy_s,
        "encode+decode (zero-copy)": zero_copy_s,
        "encode+copy+decode": joined_s,
        "zmq loopback + decode": socket_s,
    }
    print(f"group: {args.samples} samples x {args.tokens} tokens = {nbytes / 1e6:.2f} MB on the wire")
    print(f"{'path':28s} {'ms/group':>9s} {'MB/s':>9s} {'groups/s':>9s} {'x memcpy':>9s}")
    for name, seconds in rows.items():
        print(
            f"{name:28s} {seconds * 1e3:9.3f} {nbytes / seconds / 1e6:9.0f} {1 / seconds:9.0f} {seconds / memcpy_s:9.2f}"
        )
    copy_path_ratio = joined_s / memcpy_s
    print(
        f"target: encode+copy+decode within 3x of memcpy -> {copy_path_ratio:.2f}x "
        f"({'met' if copy_path_ratio <= 3 else 'MISSED'})"
    )

    def plot(ax) -> None:
        ax.barh(list(rows), [nbytes / s / 1e9 for s in rows.values()], color=["grey", "C0", "C1", "C2"])
        ax.set_xlabel("GB/s (higher is better)")
        ax.set_title(f"Wire codec: {args.samples}x{args.tokens}-token group ({nbytes / 1e6:.1f} MB)")

    result = {
        "samples": args.samples,
        "tokens": args.tokens,
        "bytes": nbytes,
        "seconds": rows,
        "mb_per_s": {k: nbytes / s / 1e6 for k, s in rows.items()},
        "ratio_to_memcpy": {k: s / memcpy_s for k, s in rows.items()},
        "target_ratio": 3.0,
    }
    save("wire_codec", {"headline": headline(result), **result}, plot)


if __name__ == "__main__":
    main()
