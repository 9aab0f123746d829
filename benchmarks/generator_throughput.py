"""Generated tokens/s of the generator inside the pipeline vs the same vLLM engine called directly vs transformers.

    .venv/bin/python -m benchmarks.generator_throughput [--prompts 16] [--group-size 4] [--max-tokens 128]

Three runs on the same prompts (the arithmetic task, chat-rendered) and the same sampling (n = group size,
temperature 1, top-p 1, up to `max_tokens` new tokens, stop at end-of-sequence), one after the other:
  pipeline     `tandem generator` (real vLLM) as its own process, leasing from a fake buffer over loopback, scoring
               with the arithmetic reward and pushing groups; tokens/s = completion tokens of the timed prompts /
               (last group acknowledged - prompts made available).
  direct       the same engine (`actors.engine.vllm.VllmEngine`, same engine arguments) in this process: every request
               added at once, stepped until done; no leases, scoring or sockets.
  transformers `generate` on the same prompts, one batch, float32 (the faster CPU path for transformers).
Both vLLM runs discard a first (warm-up) round of as many other prompts. Model: SmolLM2-135M-Instruct if prepared
(`tandem prepare-model`), else the tiny random model (the results say which). Target: pipeline >= 90% of direct.
Writes results/generator_throughput.{json,png}.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save
from benchmarks.generator_rig import benchmark_model, task_items
from common.types import PromptItem, RolloutGroup
from launch.testing import FakeBuffer, FakePublisher, RoleUnderTest, run_config, wait_until

TEMPERATURE = 1.0
SEED = 0


def run_pipeline(model_dir: Path, warmup: list[PromptItem], timed: list[PromptItem], args: Any) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-gen-"))
    config = run_config(
        tmp / "runs",
        "gen",
        model={"path": str(model_dir), "max_model_len": 1024},
        algo={"group_size": args.group_size},
        env={"reward_fn": "common.tasks:arithmetic_reward"},
        generator={
            "max_tokens": args.max_tokens,
            "temperature": TEMPERATURE,
            "prompts_in_flight": len(timed),
            "reconnect_max_s": 0.5,
        },
        run={"seed": SEED},
    )
    buffer = FakeBuffer(config, warmup, lease_size=len(timed), when_empty="full")
    buffer.retry_after_s = 0.01
    publisher = FakePublisher(config.learner.weights_port)
    buffer.start()
    publisher.start()
    generator = RoleUnderTest(config, "generator")
    try:
        with generator:
            first_groups(buffer, warmup)
            start = time.time()
            buffer.add_prompts(timed)
            mine = first_groups(buffer, timed)
            seconds = max(buffer.group_times[g.group_id] for g in mine) - start
            tokens = sum(g.num_tokens for g in mine)
            generator.stop()
    finally:
        buffer.stop()
        publisher.stop()
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def first_groups(buffer: FakeBuffer, prompts: list[PromptItem], timeout_s: float = 600.0) -> list[RolloutGroup]:
    """The first group to arrive for each of `prompts`, once every one has one. By prompt id, not by count: a
    lease that expires (a generator silent through a slow first step) is re-issued under a new lease id, and its
    second groups must not stand in for prompts still generating."""
    wanted = {p.prompt_id for p in prompts}

    def arrived() -> list[RolloutGroup] | None:
        with buffer.lock:
            first: dict[int, RolloutGroup] = {}
            for _, group in sorted(buffer.groups.items(), key=lambda item: buffer.group_times[item[0]]):
                if group.prompt_id in wanted:
                    first.setdefault(group.prompt_id, group)
        return list(first.values()) if len(first) == len(wanted) else None

    return wait_until(arrived, timeout_s, f"a group for each of {len(wanted)} prompts")


def run_direct(model_dir: Path, warmup: list[PromptItem], timed: list[PromptItem], args: Any) -> dict[str, float]:
    from actors.engine.api import SamplingSettings
    from actors.engine.vllm import VllmEngine, configure_cpu_environment
    from common.config import GeneratorConfig, ModelConfig

    configure_cpu_environment(GeneratorConfig())
    settings = SamplingSettings(TEMPERATURE, 1.0, args.max_tokens, SEED)
    engine = VllmEngine(
        model_dir,
        ModelConfig(path=str(model_dir), max_model_len=1024),
        settings,
        max_num_seqs=len(timed) * args.group_size,
        enforce_eager=True,
    )
    try:
        for round_prompts in (warmup, timed):
            rendered = [(p.prompt_id, engine.render(p)) for p in round_prompts]
            start, tokens = time.time(), 0
            for prompt_id, prompt_tokens in rendered:
                for i in range(args.group_size):
                    engine.add(f"{prompt_id}:{i}", prompt_tokens)
            while engine.num_unfinished():
                tokens += sum(len(s.completion_tokens) for s in engine.step())
            seconds = time.time() - start
    finally:
        engine.shutdown()
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def run_transformers(model_dir: Path, timed: list[PromptItem], args: Any) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from common.tasks import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = [render_prompt(tokenizer, p) for p in timed for _ in range(args.group_size)]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    torch.manual_seed(SEED)
    start = time.time()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            do_sample=True,
            temperature=TEMPERATURE,
            top_p=1.0,
            top_k=0,
            max_new_tokens=args.max_tokens,
            pad_token_id=pad,
        )
    seconds = time.time() - start
    new = out[:, width:]
    eos = tokenizer.eos_token_id
    # tokens up to and including the first end-of-sequence (what vLLM counts), the padding after it not
    tokens = sum(int((row == eos).nonzero()[0, 0]) + 1 if (row == eos).any() else len(row) for row in new)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures issues quote: tokens/s of the pipeline and of the direct engine, and their ratio (target >= 0.9)."""
    rates = {f"{name}_tokens_per_s": row["tokens_per_s"] for name, row in result["results"].items()}
    return {**rates, "pipeline_over_direct": result["pipeline_over_direct"], "target_pipeline_over_direct": 0.9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir, model_name = benchmark_model()
    warmup, timed = task_items(args.prompts), task_items(args.prompts, first_id=args.prompts)
    print(f"model: {model_name}; {args.prompts} prompts x {args.group_size} samples, <= {args.max_tokens} tokens")
    results = {"pipeline": run_pipeline(model_dir, warmup, timed, args)}
    print("pipeline", results["pipeline"], flush=True)
    results["direct"] = run_direct(model_dir, warmup, timed, args)
    print("direct", results["direct"], flush=True)
    results["transformers"] = run_transformers(model_dir, timed, args)
    print("transformers", results["transformers"], flush=True)
    rates = {name: result["tokens_per_s"] for name, result in results.items()}
    ratio = rates["pipeline"] / rates["direct"]
    print(
        f"pipeline / direct = {ratio:.1%} (target >= 90%); "
        f"pipeline / transformers = {rates['pipeline'] / rates['transformers']:.1f}x"
    )

    def plot(axes: Any) -> None:
        names = list(results)
        values = [results[n]["tokens_per_s"] for n in names]
        axes.bar(names, values, color=["tab:blue", "tab:gray", "tab:orange"])
        for i, value in enumerate(values):
            axes.text(i, value, f"{value:.0f}", ha="center", va="bottom")
        axes.set_ylabel("generated tokens / s")
        axes.set_title(f"{model_name}: {args.prompts}x{args.group_size} samples, pipeline/direct {ratio:.0%}")

    result = {
        "model": model_name,
        "settings": {
            "prompts": args.prompts,
            "group_size": args.group_size,
            "max_tokens": args.max_tokens,
            "temperature": TEMPERATURE,
            "top_p": 1.0,
            "enforce_eager": True,
        },
        "results": results,
        "pipeline_over_direct": ratio,
        "target_pipeline_over_direct": 0.9,
    }
    save("generator_throughput", {"headline": headline(result), **result}, plot)


if __name__ == "__main__":
    main()
