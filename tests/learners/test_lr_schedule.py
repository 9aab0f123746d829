"""learner.lr_schedule: the warm-up and the cosine decay to min_lr_ratio (learners.engine.lr_factor), by hand, and
the schedule a real DeepSpeed engine steps through (the offline stages set its horizon late, with decay_over)."""

from __future__ import annotations

import math

import pytest

from learners.engine import EngineSettings, lr_factor


def settings(**kwargs) -> EngineSettings:
    return EngineSettings(lr=1.0, zero_stage=0, bf16=False, micro_batch_size=1, micro_steps=1, **kwargs)


def test_constant_is_the_warm_up_then_one() -> None:
    plain = settings(warmup_steps=4)
    assert [lr_factor(s, plain) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(0, settings()) == 1.0  # no warm-up: the first step at full lr
    # decay_steps means nothing to the constant schedule
    assert lr_factor(99, settings(decay_steps=10)) == 1.0


def test_cosine_by_hand() -> None:
    # no warm-up, 5 steps, down to 0.1: progress (s + 1 - 1) / 4 = 0, 1/4, 1/2, 3/4, 1;
    # factor = 0.1 + 0.9 * (1 + cos(pi p)) / 2
    cos = settings(lr_schedule="cosine", min_lr_ratio=0.1, decay_steps=5)
    expected = [1.0, 0.1 + 0.45 * (1 + math.sqrt(0.5)), 0.55, 0.1 + 0.45 * (1 - math.sqrt(0.5)), 0.1]
    # 1e-15: a few ulps of numbers of size 1 (one cos and three products/sums in float64)
    assert [lr_factor(s, cos) for s in range(5)] == pytest.approx(expected, abs=1e-15)
    assert lr_factor(9, cos) == pytest.approx(0.1, abs=1e-15)  # flat past the horizon
    # with a warm-up of 2 the cosine starts at the warm-up's last step: 0.5, 1.0, then progress (s + 1 - 2) / 2
    warm = settings(lr_schedule="cosine", min_lr_ratio=0.0, decay_steps=4, warmup_steps=2)
    assert [lr_factor(s, warm) for s in range(4)] == pytest.approx([0.5, 1.0, 0.5, 0.0], abs=1e-15)
    # a horizon no longer than the warm-up (decay_over not called) stays constant rather than dividing by zero
    assert lr_factor(3, settings(lr_schedule="cosine", decay_steps=0)) == 1.0


@pytest.mark.deepspeed
def test_an_engine_steps_through_the_cosine_set_late() -> None:
    import torch

    from learners.engine import TrainEngine, init_distributed

    init_distributed()
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 1)
    engine = TrainEngine(module, settings(lr_schedule="cosine", min_lr_ratio=0.1, warmup_steps=1))
    engine.decay_over(3)
    seen = []
    for _ in range(4):
        seen.append(engine.learning_rate())
        engine.begin_micro_batch(last=True)
        loss = engine.engine(torch.ones(1, 3)).sum()
        engine.backward(loss)
        engine.step()
    # steps 0..3 of a 3-step horizon: progress 0, 1/2, 1, then flat at the minimum
    assert seen == pytest.approx([1.0, 0.55, 0.1, 0.1], abs=1e-12)  # float64 lambda, stored as a Python float
