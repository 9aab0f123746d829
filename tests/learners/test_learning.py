"""The learning test: reward must rise. The tiny model (real 49k vocabulary) samples with transformers from the
trainer's current weights, the reward is 1 when a completion's first token is a chosen target token, and
`Trainer.train_step` learns it, for GRPO and for PPO with a critic (gae).

Why a sampling temperature: the tiny random model is nearly uniform over 49,152 tokens (its likeliest first token
has p ~ 6e-5 at temperature 1), so no target is reachable by chance at temperature 1. The test picks the
likeliest first token (averaged over the prompts) as the target and the temperature at which that token starts
at p ~ 0.12: rare enough that the mean reward starts clearly low, frequent enough that groups of 8 see it. The
learner divides its logits by the same temperature (`generator.temperature`), as it does for vLLM's samples.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.types import RolloutGroup
from learners.engine import init_distributed
from learners.trainer import Trainer
from tests.learners.learner_fakes import learner_config

PROMPTS = ["What is 2 + 3?", "Say hi.", "Count to five.", "Name a colour."]
GROUP_SIZE = 8
MAX_NEW_TOKENS = 3
START_PROBABILITY = 0.12
MAX_STEPS = 30

pytestmark = pytest.mark.deepspeed


def prompt_ids(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for text in PROMPTS
    ]


def left_padded(prompts: list[list[int]], repeat: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    rows = [[pad_id] * (width - len(p)) + p for p in prompts for _ in range(repeat)]
    masks = [[0] * (width - len(p)) + [1] * len(p) for p in prompts for _ in range(repeat)]
    return torch.tensor(rows), torch.tensor(masks)


@torch.no_grad()
def first_token_logits(model, prompts: list[list[int]], pad_id: int) -> torch.Tensor:
    input_ids, attention_mask = left_padded(prompts, 1, pad_id)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, -1].float()


def choose_target_and_temperature(logits: torch.Tensor) -> tuple[int, float]:
    """The likeliest first token over the prompts, and the temperature giving it mean p = START_PROBABILITY."""
    target = int(logits.softmax(-1).mean(0).argmax())
    low, high = 0.01, 1.0  # p(target) falls as the temperature rises
    for _ in range(40):
        middle = (low + high) / 2
        p = float((logits / middle).softmax(-1)[:, target].mean())
        low, high = (middle, high) if p > START_PROBABILITY else (low, middle)
    return target, (low + high) / 2


@torch.no_grad()
def sample_groups(
    model, prompts: list[list[int]], temperature: float, target: int, pad_id: int, eos_id: int
) -> list[RolloutGroup]:
    """GROUP_SIZE completions per prompt from the current weights, as the generator would send them."""
    input_ids, attention_mask = left_padded(prompts, GROUP_SIZE, pad_id)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=MAX_NEW_TOKENS,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[:, input_ids.shape[1] :]  # [B, T]
    logprobs = torch.stack(out.logits, 1).float().div(temperature).log_softmax(-1)  # [B, T, V]
    logprobs = logprobs.gather(2, tokens[..., None]).squeeze(-1)  # [B, T]
    groups = []
    for g, prompt in enumerate(prompts):
        completions, behaviour, rewards = [], [], []
        for row in range(g * GROUP_SIZE, (g + 1) * GROUP_SIZE):
            ids = tokens[row].tolist()
            length = ids.index(eos_id) + 1 if eos_id in ids else len(ids)
            completions.append(np.array(ids[:length], dtype=np.int32))
            behaviour.append(logprobs[row, :length].numpy().astype(np.float32))
            rewards.append(1.0 if ids[0] == target else 0.0)
        lengths = [len(c) for c in completions]
        total = sum(lengths)
        groups.append(
            RolloutGroup(
                lease_id=0,
                prompt_id=g,
                epoch=0,
                generator_id=0,
                prompt_tokens=np.array(prompt, dtype=np.int32),
                offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
                completion_tokens=np.concatenate(completions),
                behaviour_logprobs=np.concatenate(behaviour),
                loss_mask=np.ones(total, dtype=np.uint8),
                token_versions=np.zeros(total, dtype=np.int32),
                versions=np.zeros(GROUP_SIZE, dtype=np.int32),
                rewards=np.array(rewards, dtype=np.float32),
                finish_reasons=["length"] * GROUP_SIZE,
            )
        )
    return groups


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_reward_rises_from_near_zero_to_above_0_8(tiny_model_dir, estimator: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    prompts = prompt_ids(tiny_model_dir)
    config = learner_config(
        tiny_model_dir,
        algo__estimator=estimator,
        algo__group_size=GROUP_SIZE,
        learner__groups_per_step=len(PROMPTS),
        learner__micro_batch_size=16,
        learner__lr=2e-3,
        learner__critic_lr=1e-2,
        learner__zero_stage=1,
    )
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    pad_id, eos_id = int(initial.config.pad_token_id), int(initial.config.eos_token_id)
    target, temperature = choose_target_and_temperature(first_token_logits(initial, prompts, pad_id))
    config.generator.temperature = temperature  # the learner divides its logits by the sampling temperature
    trainer = Trainer.from_config(config, init_distributed())
    model = trainer.policy.module  # ZeRO-1: the engine's module holds the full current weights
    rewards = []
    for step in range(MAX_STEPS):
        groups = sample_groups(model, prompts, temperature, target, pad_id, eos_id)
        stats = trainer.train_step(groups, [np.zeros(GROUP_SIZE, dtype=np.int32)] * len(groups))
        rewards.append(stats["reward/mean"])
        if len(rewards) >= 2 and min(rewards[-2:]) > 0.8:
            break
    print(f"{estimator}: target {target}, temperature {temperature:.3f}, rewards {np.round(rewards, 2).tolist()}")
    assert rewards[0] < 0.3
    assert min(rewards[-2:]) > 0.8, rewards
