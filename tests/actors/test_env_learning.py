"""Learning through a two-turn environment: the reward depends only on the model's SECOND turn, and it rises.

Samples come from the production episode driver (`actors.environments.episodes`) on the tiny model, sampled with transformers
from the trainer's current weights (`tests.actors.hf_engine`, as tests/learners/test_learning.py samples), and
`Trainer.train_step` (GRPO) trains on the groups the driver built: prompt, model turn 1, the environment's
observation (environment tokens, loss_mask 0), model turn 2.

The environment: turn 1 is answered "Again." (reward 0); turn 2 ends the episode with reward 1 when its text starts
with a target string. The target is the token the initial model most expects at the start of the second turn, and
the sampling temperature the one at which that token starts at p ~ START_PROBABILITY (the tiny random model is
near uniform over 49,152 tokens, see test_learning.py), both calibrated on episodes sampled at that temperature.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.environments.episodes import EpisodeDriver, EpisodeLimits
from actors.environments.runner import EnvRunner
from actors.environments.trajectory import build_episode_group
from common.envs import StepResult
from common.types import PromptItem, RolloutGroup
from launch.testing import drive_until_done
from learners.engine import init_distributed
from learners.trainer import Trainer
from tests.actors.hf_engine import HfEngine
from tests.learners.learner_fakes import learner_config

PROMPTS = ["What is 2 + 3?", "Say hi.", "Count to five.", "Name a colour."]
GROUP_SIZE = 8
TURN_TOKENS = 2
START_PROBABILITY = 0.12
MAX_STEPS = 30
FIRST_ORDINARY_TOKEN = 17  # SmolLM2's special tokens are 0..16

pytestmark = pytest.mark.deepspeed


class SecondTurnEnv:
    """Two turns; only the second is rewarded: 1 when its text starts with `target`."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.turns = 0

    def reset(self, task):
        return list(task.messages)

    def step(self, model_turn_text: str) -> StepResult:
        self.turns += 1
        if self.turns == 1:
            return StepResult([{"role": "user", "content": "Again."}], reward=0.0)
        return StepResult([], reward=float(model_turn_text.startswith(self.target)), done=True)


def run_episodes(engine: HfEngine, target: str, runner: EnvRunner) -> list[RolloutGroup]:
    limits = EpisodeLimits(
        max_turns=2,
        max_total_tokens=256,
        turn_max_tokens=TURN_TOKENS,
        max_model_len=1024,
        step_timeout_s=10.0,
        episode_timeout_s=60.0,
        failure_reward=0.0,
    )
    driver = EpisodeDriver(engine, lambda: SecondTurnEnv(target), limits, runner, GROUP_SIZE)
    for prompt_id, text in enumerate(PROMPTS):
        driver.start_group(0, PromptItem(prompt_id, 0, [{"role": "user", "content": text}], {}))
    done = drive_until_done(driver, timeout_s=120)
    groups = [build_episode_group(g.lease_id, g.prompt, g.results, 0, 0.0) for g in done]
    for group in groups:
        group.validate()
    return sorted(groups, key=lambda g: g.prompt_id)


@torch.no_grad()
def second_turn_logits(model, groups: list[RolloutGroup]) -> torch.Tensor:
    """Logits [episodes, V] at the first position of every episode's second turn (where the reward is decided)."""
    rows = []
    for group in groups:
        for i in range(group.size):
            span = slice(int(group.offsets[i]), int(group.offsets[i + 1]))
            mask = group.loss_mask[span]
            second = int(np.flatnonzero(np.diff(mask.astype(np.int8)) == 1)[0]) + 1  # env -> model boundary
            context = np.concatenate([group.prompt_tokens, group.completion_tokens[span][:second]]).astype(np.int64)
            rows.append(model(input_ids=torch.from_numpy(context)[None]).logits[0, -1].float())
    return torch.stack(rows)


def calibrate(logits: torch.Tensor) -> tuple[int, float]:
    """The likeliest ordinary token over the contexts, and the temperature giving it mean p = START_PROBABILITY."""
    mean = logits.softmax(-1).mean(0)
    mean[:FIRST_ORDINARY_TOKEN] = 0
    target = int(mean.argmax())
    low, high = 0.01, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        p = float((logits / middle).softmax(-1)[:, target].mean())
        low, high = (middle, high) if p > START_PROBABILITY else (low, middle)
    return target, (low + high) / 2


def test_reward_on_the_second_turn_rises(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    runner = EnvRunner(workers=8)
    try:
        engine = HfEngine(initial, tokenizer, temperature=1.0, max_tokens=TURN_TOKENS)
        for _ in range(2):  # calibrate on second-turn contexts sampled at the temperature found
            target, temperature = calibrate(second_turn_logits(initial, run_episodes(engine, "", runner)))
            engine.temperature = temperature
        target_text = tokenizer.decode([target])
        config = learner_config(
            tiny_model_dir,
            algo__estimator="grpo",
            algo__group_size=GROUP_SIZE,
            learner__groups_per_step=len(PROMPTS),
            learner__micro_batch_size=16,
            learner__lr=2e-3,
            generator__temperature=temperature,
        )  # the learner divides its logits by it
        trainer = Trainer.from_config(config, init_distributed())
        engine.model = trainer.policy.module  # ZeRO-1: the engine's module holds the full current weights
        rewards, env_tokens = [], []
        for step in range(MAX_STEPS):
            groups = run_episodes(engine, target_text, runner)
            env_tokens.append(int(sum((g.loss_mask == 0).sum() for g in groups)))
            stats = trainer.train_step(groups, [np.zeros(GROUP_SIZE, dtype=np.int32)] * len(groups))
            engine.policy_version = step + 1
            rewards.append(stats["reward/mean"])
            if len(rewards) >= 2 and min(rewards[-2:]) > 0.8:
                break
    finally:
        runner.close()
    print(f"target {target} ({target_text!r}), temperature {temperature:.3f}, rewards {np.round(rewards, 2).tolist()}")
    assert min(env_tokens) > 0  # every batch held environment tokens between the turns
    assert rewards[0] < 0.35
    assert min(rewards[-2:]) > 0.8, rewards
