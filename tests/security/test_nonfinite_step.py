"""Issue 12, item 5 (the learner's own guard): rewards [3e38, 3e38, 0, 0] gave a NaN loss. Whatever the buffer lets
through, a non-finite loss or gradient must skip the optimizer step on every rank: the weights stay bit-identical,
`learner/steps_skipped_nonfinite` counts it, the lr warm-up does not advance, and the next normal batch trains.

Before the guard, ZeRO-0 in float32 (torch's AdamW stepped directly) wrote NaN into every weight; ZeRO-1..3 and
bf16 skipped the step inside DeepSpeed without the learner counting or logging it. All three are played here, then
a loss that is infinite while its gradient is finite (DeepSpeed's gradient check alone lets that step through), and
two data-parallel ranks of which only one gets the hostile group.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from common.sockets import Server
from common.types import Batch, BatchRequest, Ok, VersionReport
from launch.testing import RoleUnderTest, ServerThread
from learners.trainer import Trainer
from tests.learners.learner_fakes import learner_config, process_config, synthetic_batch, synthetic_group

pytestmark = pytest.mark.deepspeed

WARMUP = 4  # lr = base * min(1, (applied steps + 1) / WARMUP): a skipped step must leave it where it was


def hostile_batch(seed: int) -> tuple[list, list]:
    """Two groups of 4; the first has the rewards that gave a NaN loss."""
    rng = np.random.default_rng(seed)
    groups = [
        synthetic_group(rng, 6, [3, 5, 2, 4], rewards=[3e38, 3e38, 0.0, 0.0]),
        synthetic_group(rng, 6, [3, 5, 2, 4], prompt_id=1),
    ]
    return groups, [np.zeros(g.size, dtype=np.int32) for g in groups]


def normal_batch(seed: int) -> tuple[list, list]:
    groups = synthetic_batch(seed, 2, 4)
    return groups, [np.zeros(g.size, dtype=np.int32) for g in groups]


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().float().clone() for name, tensor in trainer.full_weights()}


def assert_skipped_then_trains(trainer: Trainer, hostile: tuple[list, list]) -> None:
    lr, before = trainer.policy.learning_rate(), weights(trainer)
    stats = trainer.train_step(*hostile)
    assert stats["learner/steps_skipped_nonfinite"] == 1
    after = weights(trainer)
    assert all(torch.equal(before[name], after[name]) for name in before), "a skipped step changed the weights"
    assert trainer.policy.learning_rate() == lr  # the warm-up did not count it
    stats = trainer.train_step(*normal_batch(1))
    trained = weights(trainer)
    assert stats["learner/steps_skipped_nonfinite"] == 1 and math.isfinite(stats["loss/total"])
    assert all(bool(torch.isfinite(w).all()) for w in trained.values())
    assert any(not torch.equal(after[name], trained[name]) for name in after)  # the next batch trains
    assert trainer.policy.learning_rate() == pytest.approx(lr * 2)  # (1 applied + 1) / WARMUP, from 1 / WARMUP


@pytest.mark.parametrize(("zero_stage", "dtype"), [(0, "float32"), (1, "bfloat16"), (3, "float32")])
def test_a_huge_reward_skips_the_step_and_leaves_the_weights_bit_identical(
    tiny_model_dir, dist, zero_stage: int, dtype: str
) -> None:
    config = learner_config(
        tiny_model_dir,
        learner__zero_stage=zero_stage,
        model__dtype=dtype,
        learner__micro_batch_size=2,  # 4 micro-batches: the hostile group is in the first two
        learner__warmup_steps=WARMUP,
    )
    assert_skipped_then_trains(Trainer.from_config(config, dist), hostile_batch(0))


class InfiniteLossTrainer(Trainer):
    """A loss with an infinite constant added: its value is not finite, its gradient is (the plain one)."""

    def _policy_objective(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return super()._policy_objective(*args, **kwargs) + float("inf")


def test_an_infinite_loss_with_a_finite_gradient_skips_the_step_too(tiny_model_dir, dist) -> None:
    config = learner_config(tiny_model_dir, learner__warmup_steps=WARMUP)
    trainer = InfiniteLossTrainer.from_config(config, dist)
    lr, before = trainer.policy.learning_rate(), weights(trainer)
    stats = trainer.train_step(*normal_batch(0))
    assert stats["learner/steps_skipped_nonfinite"] == 1  # (loss/total is recorded before the constant is added)
    assert all(torch.equal(before[name], tensor) for name, tensor in weights(trainer).items())
    assert trainer.policy.learning_rate() == lr


class HostileShareBuffer(ServerThread):
    """A buffer that serves step 0's batch as two shares: rank 0 a normal group, rank 1 the hostile one. Version
    reports are acknowledged; nothing is checked (this is what a buffer that let the group through would do)."""

    name = "hostile-share-buffer"

    def __init__(self, port: int) -> None:
        super().__init__(port)
        groups, staleness = hostile_batch(0)
        self.shares = {0: (groups[1], staleness[1]), 1: (groups[0], staleness[0])}
        self.requests: list[BatchRequest] = []
        self.start()

    def answer(self, server: Server, request: Any) -> list[tuple[Any, Any, list[Any]]]:
        message = request.message
        if isinstance(message, VersionReport):
            return [(request, Ok(learner_version=message.policy_version), [])]
        if isinstance(message, BatchRequest):
            self.requests.append(message)
            group, staleness = self.shares[message.rank]
            return [(request, Batch(message.step, message.rank, [group], [staleness], 0), [])]
        server.reject(request, f"this fake buffer takes batch requests and version reports only, not {message}")
        return []


def test_two_ranks_skip_together_when_only_one_sees_the_hostile_group(tiny_model_dir, tmp_path: Path) -> None:
    """Rank 1's share holds the hostile group; rank 0's is normal. Both must skip (a rank that stepped alone would
    leave the ranks' weights apart, and under ZeRO hang the next collective): the run ends, its checkpoint holds the
    initial weights bit for bit, and the metrics count one skipped step."""
    from safetensors.torch import load_file

    config = process_config(
        tiny_model_dir, tmp_path, learner__world_size=2, learner__zero_stage=1, learner__total_steps=1
    )
    buffer = HostileShareBuffer(config.buffer.port)
    try:
        with RoleUnderTest(config, "learner") as learner:
            assert learner.wait(240) == 0, learner.tail()
    finally:
        buffer.stop()
    assert sorted((r.step, r.rank) for r in buffer.requests) == [(0, 0), (0, 1)]
    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "step-000001" / "hf" / "model.safetensors"))
    assert trained.keys() == initial.keys()
    assert all(torch.equal(initial[name].float(), trained[name].float()) for name in initial)
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert record["learner/steps_skipped_nonfinite"] == 1
