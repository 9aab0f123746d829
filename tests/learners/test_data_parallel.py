"""Two data-parallel ranks (`tandem learner` re-launching itself under torchrun, gloo, 2 processes) make the
same update as one rank on the same global batch.

Tolerance, in float32: max |delta W_2 ranks - delta W_1 rank| <= 1% of lr, and the relative norm of that
difference <= 1e-3. Each rank sums the gradient of its half of the batch and gloo averages the two halves: the same
numbers added in another order, ~1e-7 relative. AdamW's first step is lr * g / (|g| + eps), so that rounding moves
a weight by ~1e-7 lr wherever |g| >> eps, and by up to lr only where |g| ~ eps = 1e-8. Measured: max 2.6e-6
(ZeRO-1) and 3.7e-6 (ZeRO-3) for lr = 1e-3, relative norm 2.4e-6 / 2.8e-6. A mis-weighted rank or micro-batch
changes the direction of g and moves weights by ~lr (tests/learners/test_trainer.py shows the bound catching that).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import free_port
from tests.learners.learner_fakes import FakeBuffer, LearnerProcess, learner_config, process_config, synthetic_batch

LR = 1e-3
TOLERANCE = 1e-2 * LR
RELATIVE_TOLERANCE = 1e-3  # ||delta W_2 - delta W_1|| / ||delta W_1|| over all weights


def relative_norm(update: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    error = sum(float(((update[n] - reference[n]) ** 2).sum()) for n in reference)
    return (error / sum(float((reference[n] ** 2).sum()) for n in reference)) ** 0.5


pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def one_rank_update(tiny_model_dir) -> dict[str, torch.Tensor]:
    """One rank, in this process: the update of step 0's global batch (what FakeBuffer serves for step 0)."""
    from learners.engine import init_distributed
    from learners.trainer import Trainer

    trainer = Trainer.from_config(learner_config(tiny_model_dir, learner__lr=LR), init_distributed())
    before = {name: t.detach().clone() for name, t in trainer.full_weights()}
    groups = synthetic_batch(0, 2, 4)
    trainer.train_step(groups, [np.zeros(g.size, dtype=np.int32) for g in groups])
    return {name: t.detach().clone() - before[name] for name, t in trainer.full_weights()}


@pytest.mark.parametrize("stage", [1, 3])
def test_two_ranks_make_the_update_of_one_rank(tiny_model_dir, tmp_path: Path, one_rank_update, stage) -> None:
    from safetensors.torch import load_file

    buffer_port, weights_port = free_port(), free_port()
    config = process_config(
        tiny_model_dir,
        tmp_path,
        buffer_port,
        weights_port,
        learner__world_size=2,
        learner__zero_stage=stage,
        learner__total_steps=1,
        learner__lr=LR,
    )
    buffer = FakeBuffer(buffer_port, groups_per_step=2, group_size=4)
    try:
        with LearnerProcess(config, tmp_path / "ranks.log") as learner:
            assert learner.wait_exit(240) == 0, learner.log_tail()
    finally:
        buffer.close()
    assert sorted((r.step, r.rank, r.world_size) for r in buffer.requests) == [(0, 0, 2), (0, 1, 2)]
    assert [(r.policy_version, r.step) for r in buffer.reports] == [(0, 0), (1, 1)]  # rank 0 only
    initial = {k: v.float() for k, v in load_file(str(tiny_model_dir / "model.safetensors")).items()}
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "step-000001" / "hf" / "model.safetensors"))
    assert trained.keys() == one_rank_update.keys()
    two_rank_update = {name: trained[name] - initial[name] for name in trained}
    difference = max(float((two_rank_update[n] - one_rank_update[n]).abs().max()) for n in trained)
    relative = relative_norm(two_rank_update, one_rank_update)
    print(f"stage {stage}: max |update difference| = {difference:.3g}, relative norm {relative:.3g}")
    assert difference <= TOLERANCE and relative <= RELATIVE_TOLERANCE
    assert max(float(d.abs().max()) for d in one_rank_update.values()) == pytest.approx(LR, rel=0.01)
