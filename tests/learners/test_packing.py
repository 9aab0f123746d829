"""Token-budget micro-batches and sequence packing (learner.max_tokens_per_micro_batch, learner.packing): the bins,
the packed forward against each sample alone, and the update against the padded fixed-size one.

The update comparisons reuse tests/learners/test_trainer.py's bounds, derived there: the gradient of the global
batch within GRADIENT_TOLERANCE = 64 eps_f32 x max |g_ref| per tensor, and the AdamW step within 1e-3 lr + eps_f32 |W|
where it is well conditioned. They apply unchanged: packing and token budgets change which samples share a forward
and how wide its rows are, so only the order of float32 sums (the blocking of the matmuls over a micro-batch's
positions, the accumulation over micro-batches, softmax over a differently masked row) changes, never the math: the
positions a sample sees are its own (position_ids restart at 0), and every micro-batch's loss is weighted by its
share of the batch's loss units as before. Here the batch is 16 samples of up to 28 tokens, so a gradient entry
sums <= 448 positions: ~sqrt(448) = 21 eps_f32 per reduction, a few in series, within 64 eps_f32 (measured: the
packed gradient within ~2 eps_f32 of the padded one on an AMD EPYC). Attention leaking across two packed samples,
or a predicting position off by one, moves log-probs by ~0.1 and the gradient by far more than the bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learners.batching import (
    first_fit_decreasing,
    next_fit_decreasing,
    pad_groups,
    split_to_count,
    token_budget_micro_batches,
)
from learners.trainer import Trainer
from tests.learners.learner_fakes import learner_config, synthetic_group
from tests.learners.test_trainer import GRADIENT_TOLERANCE, Step, gradient_error, one_step, update_excess, weights

PAD = 2


def spread_batch(seed: int = 5) -> tuple[list, list]:
    """4 groups of 4 with completions of 1-20 tokens and prompts of 4-8: lengths that pack unevenly."""
    rng = np.random.default_rng(seed)
    groups = [
        synthetic_group(rng, int(rng.integers(4, 9)), [int(x) for x in rng.integers(1, 21, 4)], lease_id=g)
        for g in range(4)
    ]
    return groups, [np.zeros(g.size, dtype=np.int32) for g in groups]


def test_bins_respect_the_capacity_and_an_oversized_item_is_alone() -> None:
    sizes = [5, 9, 3, 12, 7, 1, 4]
    for pack in (first_fit_decreasing, next_fit_decreasing):
        bins = pack(sizes, 10)
        assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
        assert [3] in bins  # 12 > 10: a bin of its own
        assert all(sum(sizes[i] for i in b) <= 10 for b in bins if b != [3])
    assert first_fit_decreasing(sizes, 10) == [[3], [1, 5], [4, 2], [0, 6]]
    assert next_fit_decreasing(sizes, 10) == [[3], [1], [4], [0, 6], [2, 5]]  # runs of 12 9 7 5 4 3 1


def test_token_budget_micro_batches_and_split_to_count() -> None:
    tokens = torch.tensor([30, 8, 8, 8, 20, 12, 5, 5])
    parts = token_budget_micro_batches(tokens, slice(4, 8), 25, packed=True)
    assert sorted(r for p in parts for r in p.tolist()) == [4, 5, 6, 7]
    assert all(int(tokens[p].sum()) <= 25 for p in parts)
    more = split_to_count(parts, 4)
    assert len(more) == 4 and sorted(r for p in more for r in p.tolist()) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="cannot fill 5 micro-batches"):
        split_to_count(parts, 5)


def test_packed_forward_matches_each_sample_alone(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    from learners.logprobs import logprobs_from_logits

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert model.config._attn_implementation == "sdpa"  # the mask from position_ids below is built for sdpa
    batch = pad_groups(*spread_batch(), PAD)
    rows = torch.tensor([3, 0, 9, 12, 5, 7, 1])
    inputs = batch.model_inputs(rows, torch.device("cpu"), packed=True)
    assert inputs.input_ids.shape[0] < len(rows)  # samples do share rows
    assert inputs.input_ids.shape[1] == int(batch.sample_tokens()[rows].max())  # rows no wider than the longest
    assert inputs.real_tokens == int(batch.sample_tokens()[rows].sum())
    with torch.no_grad():
        logits = inputs.predicting(model(**inputs.forward_kwargs(), logits_to_keep=inputs.keep, use_cache=False).logits)
        packed = logprobs_from_logits(logits, inputs.completion_tokens)  # [b, T']
        for k, row in enumerate(rows.tolist()):
            n = int(batch.completion_lengths[row])
            prompt = torch.from_numpy(batch.prompts[row].astype(np.int64))
            alone = torch.cat([prompt, batch.completion_tokens[row, :n]])[None]
            expected = logprobs_from_logits(
                model(input_ids=alone).logits[:, len(prompt) - 1 : -1], batch.completion_tokens[row : row + 1, :n]
            )[0]
            # float32 summation order only: 64 eps_f32 |log p| (tests/learners/test_batching.py's bound)
            atol = 64 * torch.finfo(torch.float32).eps * float(expected.abs().max())
            torch.testing.assert_close(packed[k, :n], expected, rtol=0, atol=atol)
        # the rows end to end (flash-attention's layout; sdpa reads the same position_ids): the same log-probs
        flat = batch.model_inputs(rows, torch.device("cpu"), packed=True, one_row=True)
        assert flat.input_ids.shape == (1, inputs.input_ids.numel())
        logits = flat.predicting(model(**flat.forward_kwargs(), logits_to_keep=flat.keep, use_cache=False).logits)
        lengths = batch.completion_lengths[rows]
        valid = torch.arange(packed.shape[1]) < lengths[:, None]
        atol = 64 * torch.finfo(torch.float32).eps * float(packed.abs().max())
        torch.testing.assert_close(
            logprobs_from_logits(logits, flat.completion_tokens)[valid], packed[valid], rtol=0, atol=atol
        )


def captured_step(model_dir, dist, batch, **overrides) -> Step:
    """One train_step of a fresh trainer, the gradient of the global batch captured at the accumulation boundary."""
    from deepspeed.utils import safe_get_full_grad

    trainer = Trainer.from_config(
        learner_config(model_dir, algo__group_size=4, learner__groups_per_step=4, **overrides), dist
    )
    policy, gradients = trainer.policy, {}
    step = policy.step

    def capture_then_step() -> None:
        if policy.engine.is_gradient_accumulation_boundary():
            for name, param in policy.module.named_parameters():
                gradients[name] = safe_get_full_grad(param).detach().float().clone()
        step()

    policy.step = capture_then_step
    before = weights(trainer)
    stats = trainer.train_step(*batch)
    after = weights(trainer)
    assert trainer.policy.optimizer_steps == 1
    return Step(before, gradients, {name: after[name] - before[name] for name in before}, stats, trainer)


def assert_same_update(step: Step, reference: Step) -> None:
    error, where = gradient_error(step, reference)
    assert error <= GRADIENT_TOLERANCE, f"max |g - g_ref| = {error / 1.19e-7:.1f} eps_f32 x max |g_ref| over {where}"
    assert update_excess(step, reference) <= 0


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [0, 3])  # 3: the unfused log-probs (logits at every packed position)
def test_packed_and_token_budget_updates_equal_the_padded_fixed_size_one(tiny_model_dir, dist, stage) -> None:
    batch = spread_batch()
    reference = captured_step(tiny_model_dir, dist, batch, learner__zero_stage=stage, learner__micro_batch_size=16)
    budget = captured_step(
        tiny_model_dir, dist, batch, learner__zero_stage=stage, learner__max_tokens_per_micro_batch=60
    )
    packed = captured_step(
        tiny_model_dir,
        dist,
        batch,
        learner__zero_stage=stage,
        learner__max_tokens_per_micro_batch=60,
        learner__packing=True,
    )
    assert_same_update(budget, reference)
    assert_same_update(packed, reference)
    tokens = int(pad_groups(*batch, PAD).sample_tokens().sum())
    for step in (budget, packed):
        assert step.stats["perf/tokens_per_micro_batch"] <= 60
        assert step.stats["perf/tokens_per_micro_batch"] * -(-tokens // 60) >= tokens * 0.5  # few, full bins
    for step in (budget, packed):  # one micro-batch padded to its longest sample wastes the most
        assert step.stats["perf/padding_fraction"] < reference.stats["perf/padding_fraction"]
    assert reference.stats["perf/peak_rss_mb"] > 0
    assert packed.stats["loss/policy"] == pytest.approx(reference.stats["loss/policy"], abs=1e-5)


@pytest.mark.deepspeed
def test_the_critic_reads_its_values_at_the_packed_positions(tiny_model_dir, dist) -> None:
    batch = spread_batch()
    gae = {"algo__estimator": "gae", "learner__critic_lr": 1e-2, "learner__zero_stage": 0}
    padded = captured_step(tiny_model_dir, dist, batch, learner__micro_batch_size=16, **gae)
    packed = captured_step(
        tiny_model_dir, dist, batch, learner__max_tokens_per_micro_batch=60, learner__packing=True, **gae
    )
    assert_same_update(packed, padded)
    assert packed.stats["loss/value"] == pytest.approx(padded.stats["loss/value"], rel=1e-5)
    # the head starts at 0 (V = 0 everywhere), so its first AdamW step is lr x the sign of its gradient, a sum of
    # the backbone's hidden states at the positions read: another position flips signs (a change of ~2 lr); the
    # same positions leave rounding only (the update bound of tests/learners/test_trainer.py, at the critic's lr)
    heads = [s.trainer.critic.module.value_head.weight.detach() for s in (packed, padded)]
    assert float(heads[1].abs().max()) == pytest.approx(1e-2, rel=0.01)  # it moved by ~lr
    assert float((heads[0] - heads[1]).abs().max()) <= 1e-3 * 1e-2


@pytest.mark.deepspeed
def test_two_ranks_with_different_micro_batch_counts_make_the_update_of_one_rank(
    tiny_model_dir, tmp_path, dist
) -> None:
    """Under a budget of 20 tokens rank 0's group (13, 12, 11, 11 tokens) makes 4 micro-batches and rank 1's (7, 8,
    8, 8) makes 2, split to 4 so that both ranks reach the accumulation boundary together: a rank that stopped
    early would hang the other (the gloo all-reduce at the boundary) and the run would time out. The bound is
    tests/learners/test_data_parallel.py's (one rank against two, well-conditioned weights)."""
    from safetensors.torch import load_file

    from tests.learners.learner_fakes import process_config, run_learner_to_end, synthetic_batch

    groups = synthetic_batch(0, 2, 4)  # what SyntheticBuffer serves for step 0
    one_rank_step = one_step(tiny_model_dir, dist, (groups, [np.zeros(g.size, dtype=np.int32) for g in groups]))
    config = process_config(
        tiny_model_dir,
        tmp_path,
        learner__world_size=2,
        learner__zero_stage=1,
        learner__total_steps=1,
        learner__max_tokens_per_micro_batch=20,
        learner__packing=True,
    )
    run_learner_to_end(config, groups_per_step=2, group_size=4)
    initial = {k: v.float() for k, v in load_file(str(tiny_model_dir / "model.safetensors")).items()}
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "step-000001" / "hf" / "model.safetensors"))
    two_ranks = Step(initial, {}, {name: trained[name].float() - initial[name] for name in trained}, {}, None)
    assert update_excess(two_ranks, one_rank_step) <= 0
