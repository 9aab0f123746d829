"""Two data-parallel ranks (`tandem learner` re-launching itself under torchrun, gloo, 2 processes) make the
same update as one rank on the same global batch.

The two-rank run is another process, so only its weights come back; its AdamW step is compared with the one-rank
step where that step is well conditioned, with the bound of tests/learners/test_trainer.py (its docstring derives
it): where the clipped one-rank gradient |g| >= 1000 eps_adam, |delta W_2 ranks - delta W_1 rank| <= eps_f32 |W| +
1e-3 lr. Each rank sums the gradient of its half of the batch and gloo averages the two halves: the same numbers
added in another order, a few eps_f32 relative, which moves a well-conditioned step by < 1e-3 lr. Elsewhere
(|g| ~ eps_adam = 1e-8, most rows of the tied embedding) the first step lr * g / (|g| + eps_adam) turns that
rounding into up to lr, on some CPUs more than on others: those weights are not compared. A mis-weighted rank, a
rank that trained on the other's share, or a lost all-reduce moves well-conditioned weights by ~lr.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.learners.learner_fakes import process_config, run_learner_to_end, synthetic_batch
from tests.learners.test_trainer import Step, one_step, update_excess

LR = 1e-3  # test_trainer's LR, which its UPDATE_TOLERANCE is relative to

pytestmark = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def one_rank_step(tiny_model_dir) -> Step:
    """One rank, in this process: the step of step 0's global batch (what SyntheticBuffer serves for step 0)."""
    from learners.engine import init_distributed

    groups = synthetic_batch(0, 2, 4)
    batch = groups, [np.zeros(g.size, dtype=np.int32) for g in groups]
    return one_step(tiny_model_dir, init_distributed(), batch, learner__lr=LR)


@pytest.mark.parametrize("stage", [1, 3])
def test_two_ranks_make_the_update_of_one_rank(tiny_model_dir, tmp_path: Path, one_rank_step, stage) -> None:
    from safetensors.torch import load_file

    config = process_config(
        tiny_model_dir,
        tmp_path,
        learner__world_size=2,
        learner__zero_stage=stage,
        learner__total_steps=1,
        learner__lr=LR,
    )
    buffer = run_learner_to_end(config, groups_per_step=2, group_size=4)
    assert sorted((r.step, r.rank, r.world_size) for r in buffer.requests) == [(0, 0, 2), (0, 1, 2)]
    assert [(r.policy_version, r.step) for r in buffer.reports] == [(0, 0), (1, 1)]  # rank 0 only
    initial = {k: v.float() for k, v in load_file(str(tiny_model_dir / "model.safetensors")).items()}
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "step-000001" / "hf" / "model.safetensors"))
    assert trained.keys() == one_rank_step.update.keys()
    assert all(torch.equal(initial[name], one_rank_step.before[name]) for name in initial)  # one starting point
    two_ranks = Step(initial, {}, {name: trained[name].float() - initial[name] for name in trained}, {}, None)
    excess = update_excess(two_ranks, one_rank_step)
    print(f"stage {stage}: max |update difference| - eps_f32 |W| - 1e-3 lr = {excess:.3g} (<= 0 passes)")
    assert excess <= 0
    assert max(float(d.abs().max()) for d in one_rank_step.update.values()) == pytest.approx(LR, rel=0.01)
