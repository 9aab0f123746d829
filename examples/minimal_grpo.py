"""GRPO on one page: sample, score, compute advantages, update; eta = 0, one process, no vLLM, no DeepSpeed.

    .venv/bin/python -m examples.minimal_grpo                    # the embedded SmolLM2-135M-Instruct, 20 steps
    .venv/bin/python -m examples.minimal_grpo --model tiny --steps 2 --eval-prompts 4   # seconds, random weights

What Tandem's roles do across processes, read top to bottom in one loop (as cleanrl's ppo.py reads): the
generator's sampling is `model.generate`, the reward is the arithmetic task's verifier, and the learner's math is
the very functions the RL learner calls: `learners.estimators.batch_advantages` (GRPO's group-normalised
advantages), `learners.logprobs.logprobs_from_logits` and `learners.losses.policy_loss` (PPO's clipped objective).
With eta = 0 there is no stale sampler: the proximal log-probs (the trust region's centre) are the policy's own
before the update, and no importance correction applies. Everything asynchronous (staleness, the replay buffer,
weight broadcast, several generators) is what `tandem run` adds around this loop.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import AlgoConfig
from common.model_prep import resolve_model_path
from common.tasks import arithmetic_prompts, arithmetic_reward, render_prompt
from learners.estimators import batch_advantages
from learners.logprobs import logprobs_from_logits
from learners.losses import policy_loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny, tiny:<family> or a model directory")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (one batch of groups each)")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="groups per batch")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=48, help="longest completion")
    parser.add_argument("--difficulty", type=int, default=1, help="arithmetic level, 1..5 (common.tasks)")
    parser.add_argument("--shots", type=int, default=1, help="worked examples before each question (the format)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--ppo-epochs", type=int, default=2, help="passes over each batch (the clip acts from the 2nd)")
    parser.add_argument("--eval-prompts", type=int, default=32, help="held-out questions, answered greedily")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------- sampling
@torch.no_grad()
def generate(model: Any, tokenizer: Any, prompts: list[list[int]], n: int, max_tokens: int, greedy: bool) -> dict:
    """`n` completions of each prompt. Returns the left-padded prompts and the completions as [B, P] / [B, T]
    tensors (B = len(prompts) x n, each prompt's completions adjacent) and the completions' action mask: 1 on
    every sampled token up to and including the first end-of-sequence token, 0 after it."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # [N, P]  left-padded
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [N, P]
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        do_sample=not greedy,
        temperature=1.0 if not greedy else None,
        top_p=None,
        top_k=None,
        max_new_tokens=max_tokens,
        num_return_sequences=n,
        pad_token_id=pad,
    )
    completions = out[:, width:]  # [B, T]
    ended = (completions == tokenizer.eos_token_id).long().cumsum(dim=1)  # [B, T]  1 from the first EOS on
    action_mask = (ended - (completions == tokenizer.eos_token_id).long()) == 0  # [B, T]  up to and incl. EOS
    return {
        "prompt_ids": prompt_ids.repeat_interleave(n, dim=0),
        "prompt_mask": prompt_mask.repeat_interleave(n, dim=0),
        "completions": completions,
        "action_mask": action_mask,
    }


def completion_logprobs(model: Any, batch: dict) -> torch.Tensor:
    """log pi(token) of every completion token [B, T] under `model` (sampling temperature 1)."""
    tokens = torch.cat([batch["prompt_ids"], batch["completions"]], dim=1)  # [B, P + T]
    attention = torch.cat([batch["prompt_mask"], batch["action_mask"].long()], dim=1)  # [B, P + T]
    positions = (attention.cumsum(dim=1) - 1).clamp(min=0)  # left padding: positions start at the first real token
    completion_len = batch["completions"].shape[1]
    # only the positions that predict completion tokens: [B, T + 1, V] logits, not [B, P + T, V] (the vocabulary is
    # 49k: the whole sequence's logits of a batch of 32 would take GBs)
    out = model(input_ids=tokens, attention_mask=attention, position_ids=positions, logits_to_keep=completion_len + 1)
    return logprobs_from_logits(out.logits[:, :-1].float(), batch["completions"])  # [B, T]


def score(tokenizer: Any, batch: dict, records: list[Any], n: int) -> torch.Tensor:
    """The verifier's reward (correct + format bonus) of every completion [B]."""
    texts = tokenizer.batch_decode(batch["completions"] * batch["action_mask"], skip_special_tokens=True)
    return torch.tensor([sum(arithmetic_reward(t, records[i // n].metadata).values()) for i, t in enumerate(texts)])


def held_out_accuracy(model: Any, tokenizer: Any, records: list[Any], max_tokens: int) -> float:
    """Greedy strict accuracy (right answer after the `####` marker) on held-out questions."""
    batch = generate(model, tokenizer, [render_prompt(tokenizer, r) for r in records], 1, max_tokens, greedy=True)
    texts = tokenizer.batch_decode(batch["completions"] * batch["action_mask"], skip_special_tokens=True)
    rewards = [arithmetic_reward(t, r.metadata, format_weight=1.0) for t, r in zip(texts, records, strict=True)]
    return statistics.fmean(float(r["correct"] == 1.0 and r["format"] == 1.0) for r in rewards)


# ------------------------------------------------------------------------------------------- the loop
def load(spec: str) -> tuple[Any, Any]:
    """The policy (float32, eval mode: no dropout, so the log-probs are those of the policy that sampled) and its
    tokenizer, padding on the left for batched generation."""
    path = resolve_model_path(spec)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval(), tokenizer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model, tokenizer = load(args.model)
    return train(model, tokenizer, args)


def train(model: Any, tokenizer: Any, args: argparse.Namespace, score_fn: Any = score) -> dict[str, Any]:
    """GRPO for `args.steps` steps on the arithmetic task, `score_fn` the reward (default: the verifier)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    algo = AlgoConfig(estimator="grpo")  # the learner's own defaults: clip [0.8, 1.28], token-mean aggregation

    questions = arithmetic_prompts(
        args.steps * args.prompts_per_step, seed=args.seed, difficulty=args.difficulty, split="train", shots=args.shots
    )
    held_out = arithmetic_prompts(
        args.eval_prompts, seed=args.seed, difficulty=args.difficulty, split="held_out", shots=args.shots
    )
    history = {"accuracy_before": held_out_accuracy(model, tokenizer, held_out, args.max_tokens), "steps": []}
    print(f"held-out greedy strict accuracy before training: {history['accuracy_before']:.3f}")

    n, per_step = args.group_size, args.prompts_per_step
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        # 1. Sample: a group of n completions of each prompt from the current policy (the generator's job).
        records = questions[(step - 1) * per_step : step * per_step]
        batch = generate(model, tokenizer, [render_prompt(tokenizer, r) for r in records], n, args.max_tokens, False)
        # 2. Score with the verifier (the reward function's job).
        rewards = score_fn(tokenizer, batch, records, n)  # [B]
        # 3. Advantages: each completion's reward against its group's mean, over the group's std (GRPO).
        group_ids = torch.arange(per_step).repeat_interleave(n)  # [B]
        mask = batch["action_mask"]
        advantages, _ = batch_advantages(algo, rewards, group_ids, mask)  # [B, T]
        # 4. The proximal log-probs: the policy before this batch's updates (eta = 0: also the sampler's).
        with torch.no_grad():
            proximal = completion_logprobs(model, batch)  # [B, T]
        # 5. Update: the clipped policy loss, ppo_epochs passes over the batch (the learner's job).
        for _ in range(args.ppo_epochs):
            logprobs = completion_logprobs(model, batch)  # [B, T]
            loss, stats = policy_loss(
                logprobs,
                proximal,
                None,
                advantages,
                mask,
                clip_low=algo.clip_low,
                clip_high=algo.clip_high,
                aggregation=algo.aggregation,
            )
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        row = {
            "step": step,
            "reward_mean": rewards.mean().item(),
            "loss": loss.item(),
            "clip_frac": stats["clip_frac"].item(),
            "completion_tokens": mask.sum(dim=1).float().mean().item(),
            "seconds": time.perf_counter() - started,
        }
        history["steps"].append(row)
        print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)

    history["accuracy_after"] = held_out_accuracy(model, tokenizer, held_out, args.max_tokens)
    print(f"held-out greedy strict accuracy after {args.steps} steps: {history['accuracy_after']:.3f}")
    return history


if __name__ == "__main__":
    main()
