"""Learner tokens/s with padded micro-batches against token-budget micro-batches with sequence packing, on
batches with a chain-of-thought length spread, at an identical update.

    .venv/bin/python -m benchmarks.learner_packing [--model smollm2|tiny|DIR] [--dtype float32|bfloat16]
        [--steps 1] [--groups 2] [--budget 4096] [--threads 1]

The batch: `--groups` groups x 8 samples, prompts of 40 tokens, completions uniform in 32-512 tokens (random ids:
the cost does not depend on the values). Padded: learner.micro_batch_size = 8 (each micro-batch padded to its
longest sample, today's layout). Packed: learner.max_tokens_per_micro_batch = `--budget` and learner.packing (rows
no wider than the micro-batch's longest sample). Both: one rank, ZeRO-1, GRPO with TIS, float32 by default (about
1.6x faster than bfloat16 on these CPUs), `--threads` torch threads (1: the demo's learner is pinned to one core).
Each way runs in a fresh process (so `peak_rss_mb`, getrusage's ru_maxrss of that process, is its own): one
warm-up step on a short batch, then `--steps` timed `train_step` calls on the spread batches (the same batches
both ways). tokens/s = prompt + completion tokens per second of train_step. "Identical update": the weights after
the step are compared (max |W_packed - W_padded| over the policy, in units of the lr; a different update moves
weights by ~lr, rounding by << lr).

Writes results/learner_packing.json; headline: packed_over_padded (target >= 1.5), padded_tokens_per_s,
packed_tokens_per_s, padding_fraction_padded, padding_fraction_packed, dtype, threads, and the peak memory of each.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from typing import Any

import numpy as np

from benchmarks.common import save
from benchmarks.learner_throughput import GROUP_SIZE, PROMPT_TOKENS, random_batch
from common.types import RolloutGroup

COMPLETION_TOKENS, LR = (32, 513), 1e-6
COMPARED = "model.layers.0.self_attn.q_proj.weight"  # the tensor whose update the two ways compare (kept small)


def spread_batch(seed: int, groups: int, completion_tokens: tuple[int, int] = COMPLETION_TOKENS) -> list[RolloutGroup]:
    """`groups` groups of 8 samples, prompts of 40 tokens, completions of 32-512 (the demo batch's builder)."""
    return random_batch(seed, groups, completion_tokens)


def run_way(way: str, model_dir: str, args: dict[str, Any]) -> dict[str, Any]:
    """One way (`padded` or `packed`), in this (fresh) process: the timed steps' figures and the compared update."""
    import torch

    from common.config import load_config
    from learners.engine import init_distributed
    from learners.trainer import Trainer

    torch.set_num_threads(args["threads"])
    values = {
        "model.path": model_dir,
        "model.dtype": args["dtype"],
        "algo.group_size": GROUP_SIZE,
        "learner.groups_per_step": args["groups"],
        "learner.lr": LR,
        "learner.zero_stage": 1,
        "learner.micro_batch_size": 8,
    }
    if way == "packed":
        values.update({"learner.max_tokens_per_micro_batch": args["budget"], "learner.packing": True})
    trainer = Trainer.from_config(load_config(None, values), init_distributed())
    staleness = [np.zeros(GROUP_SIZE, dtype=np.int32)] * args["groups"]
    trainer.train_step(spread_batch(1000, args["groups"], (32, 64)), staleness)  # warm-up, short
    before = dict(trainer.full_weights())[COMPARED].detach().float().clone()
    records = []
    for step in range(args["steps"]):
        start = time.perf_counter()
        stats = trainer.train_step(spread_batch(step, args["groups"]), staleness)
        stats["seconds"] = time.perf_counter() - start
        records.append(stats)
        print(f"  {way} step {step}: {stats['seconds']:.1f}s, {stats['perf/tokens'] / stats['seconds']:.0f} tok/s")
    after = dict(trainer.full_weights())[COMPARED].detach().float().clone()
    seconds = float(np.sum([r["seconds"] for r in records]))
    tokens = float(np.sum([r["perf/tokens"] for r in records]))
    return {
        "step_s": seconds / len(records),
        "tokens_per_step": tokens / len(records),
        "tokens_per_s": tokens / seconds,
        "forward_s": float(np.mean([r["perf/forward_s"] for r in records])),
        "backward_s": float(np.mean([r["perf/backward_s"] for r in records])),
        "padding_fraction": float(np.mean([r["perf/padding_fraction"] for r in records])),
        "tokens_per_micro_batch": float(np.mean([r["perf/tokens_per_micro_batch"] for r in records])),
        "peak_rss_mb": float(records[-1]["perf/peak_rss_mb"]),
        "loss_policy": [float(r["loss/policy"]) for r in records],
        "update": (after - before).numpy(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny or a model directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model.dtype")
    parser.add_argument("--steps", type=int, default=1, help="timed steps each way (after one short warm-up)")
    parser.add_argument("--groups", type=int, default=2, help="groups of 8 samples per batch")
    parser.add_argument("--budget", type=int, default=4096, help="packed: learner.max_tokens_per_micro_batch")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the demo's learner has one core)")
    args = parser.parse_args(argv)
    from benchmarks.learner_throughput import resolve_model

    model_dir, model_name = resolve_model(args.model)
    settings = {k: getattr(args, k) for k in ("dtype", "steps", "groups", "budget", "threads")}
    context = multiprocessing.get_context("spawn")
    ways = {}
    for way in ("padded", "packed"):
        with context.Pool(1) as pool:  # a fresh process each: its own peak memory
            ways[way] = pool.apply(run_way, (way, str(model_dir), settings))
    padded, packed = ways["padded"], ways["packed"]
    update_diff = float(np.abs(packed.pop("update") - padded["update"]).max())
    update_size = float(np.abs(padded.pop("update")).max())
    result = {
        "model": model_name,
        **settings,
        "batch": f"{args.groups} groups x {GROUP_SIZE}, prompts {PROMPT_TOKENS}, completions {COMPLETION_TOKENS[0]}-"
        f"{COMPLETION_TOKENS[1] - 1} tokens",
        "padded": padded,
        "packed": packed,
        "update_compared": COMPARED,
        "update_max_abs_over_lr": update_size / LR,
        "update_max_diff_over_lr": update_diff / LR,
    }
    result["headline"] = {
        "packed_over_padded": packed["tokens_per_s"] / padded["tokens_per_s"],
        "padded_tokens_per_s": padded["tokens_per_s"],
        "packed_tokens_per_s": packed["tokens_per_s"],
        "padding_fraction_padded": padded["padding_fraction"],
        "padding_fraction_packed": packed["padding_fraction"],
        "peak_rss_mb_padded": padded["peak_rss_mb"],
        "peak_rss_mb_packed": packed["peak_rss_mb"],
        "update_max_diff_over_lr": update_diff / LR,
        "dtype": args.dtype,
        "threads": args.threads,
        "model": model_name,
    }
    save("learner_packing", result)
    for key, value in result["headline"].items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
