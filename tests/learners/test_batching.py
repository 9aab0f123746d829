"""Padding rollout groups into tensors: alignment invariants, micro-batch splits, and the padded forward pass
giving the same log-probs as each sample alone (left-padded prompts, right-padded completions)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from learners.batching import pad_groups, split_rows
from learners.rollout_stats import rollout_summary
from tests.learners.learner_fakes import synthetic_batch, synthetic_group

PAD = 2


def test_pad_groups_aligns_every_sample_with_its_group() -> None:
    rng = np.random.default_rng(0)
    groups = [synthetic_group(rng, 5, [3, 1, 4], version=2), synthetic_group(rng, 2, [2, 6], version=1)]
    groups[0].loss_mask.flags.writeable = True
    groups[0].loss_mask[1] = 0  # an environment token inside sample 0
    batch = pad_groups(groups, [np.array([0, 0, 0]), np.array([1, 1])], PAD, first_group_id=10)
    assert batch.size == 5 and batch.width == 6
    assert batch.completion_lengths.tolist() == [3, 1, 4, 2, 6]
    assert batch.group_ids.tolist() == [10, 10, 10, 11, 11]
    assert batch.staleness.tolist() == [0, 0, 0, 1, 1]
    assert batch.rewards.tolist() == pytest.approx(np.concatenate([g.rewards for g in groups]).tolist())
    for row, (group, i) in enumerate([(groups[0], 0), (groups[0], 1), (groups[0], 2), (groups[1], 0), (groups[1], 1)]):
        span = slice(int(group.offsets[i]), int(group.offsets[i + 1]))
        n = span.stop - span.start
        assert batch.completion_tokens[row, :n].tolist() == group.completion_tokens[span].tolist()
        assert (batch.completion_tokens[row, n:] == PAD).all()
        assert batch.loss_mask[row, :n].tolist() == (group.loss_mask[span] == 1).tolist()
        assert not batch.loss_mask[row, n:].any()
        assert (batch.behaviour_logprobs[~batch.loss_mask] == 0).all()
        assert batch.prompts[row] is group.prompt_tokens
    assert not batch.loss_mask[0, 1]
    assert batch.num_tokens() == 3 * 5 + 2 * 2 + 16


def test_pad_groups_rejects_mismatched_staleness_and_empty_batches() -> None:
    groups = synthetic_batch(0, 2, 3)
    with pytest.raises(ValueError, match="one array per group"):
        pad_groups(groups, [np.zeros(3)], PAD)
    with pytest.raises(ValueError, match="staleness\\[1\\] has 2 entries"):
        pad_groups(groups, [np.zeros(3), np.zeros(2)], PAD)
    with pytest.raises(ValueError, match="no samples"):
        pad_groups([], [], PAD)


@pytest.mark.parametrize("rows, steps", [(8, 4), (10, 4), (5, 5), (7, 1)])
def test_split_rows_makes_exactly_the_micro_steps_covering_all_rows(rows: int, steps: int) -> None:
    parts = split_rows(rows, steps)
    assert len(parts) == steps
    assert [i for p in parts for i in range(p.start, p.stop)] == list(range(rows))
    sizes = [p.stop - p.start for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_split_rows_refuses_fewer_rows_than_micro_steps() -> None:
    with pytest.raises(ValueError, match="cannot fill 4 micro-batches"):
        split_rows(3, 4)


def test_model_inputs_left_pad_prompts_and_count_positions_over_real_tokens() -> None:
    rng = np.random.default_rng(1)
    groups = [synthetic_group(rng, 3, [2]), synthetic_group(rng, 5, [4])]
    batch = pad_groups(groups, [np.zeros(1), np.zeros(1)], PAD)
    inputs = batch.model_inputs(slice(0, 2), torch.device("cpu"))
    assert inputs.input_ids.shape == (2, 5 + 4) and inputs.width == 4 and inputs.num_predicted == 5
    assert inputs.attention_mask[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0]
    assert inputs.position_ids[0, 2:7].tolist() == [0, 1, 2, 3, 4]
    assert inputs.input_ids[0, 2:5].tolist() == groups[0].prompt_tokens.tolist()
    assert inputs.input_ids[0, 5:7].tolist() == groups[0].completion_tokens.tolist()
    assert inputs.position_ids[1].tolist() == list(range(9))


def test_padded_forward_matches_each_sample_alone(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    from learners.logprobs import logprobs_from_logits

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    groups = synthetic_batch(3, 2, 3)
    batch = pad_groups(groups, [np.zeros(3), np.zeros(3)], PAD)
    inputs = batch.model_inputs(slice(0, batch.size), torch.device("cpu"))
    with torch.no_grad():
        logits = model(**inputs.forward_kwargs(), logits_to_keep=inputs.num_predicted).logits[:, :-1]
        padded = logprobs_from_logits(logits, inputs.completion_tokens)  # [B, T']
        for row in range(batch.size):
            n = int(batch.completion_lengths[row])
            alone = torch.cat(
                [torch.from_numpy(batch.prompts[row].astype(np.int64)), batch.completion_tokens[row, :n]]
            )[None]
            logits_alone = model(input_ids=alone).logits[:, len(batch.prompts[row]) - 1 : -1]
            expected = logprobs_from_logits(logits_alone, batch.completion_tokens[row : row + 1, :n])[0]
            # float32 summation order only (other shapes, masked attention): 64 eps_f32 |log p| ~ 8.5e-5, derived
            # in tests/learners/test_trainer.py; bit-equal on an Intel Xeon. One position off misses by ~0.3 nats,
            # attention leaking into two pad tokens by ~0.06.
            atol = 64 * torch.finfo(torch.float32).eps * float(expected.abs().max())
            torch.testing.assert_close(padded[row, :n], expected, rtol=0, atol=atol)


def test_rollout_summary_counts_rewards_staleness_and_tokens() -> None:
    rng = np.random.default_rng(0)
    groups = [synthetic_group(rng, 4, [2, 3], rewards=[1.0, 0.0]), synthetic_group(rng, 6, [1, 1], rewards=[1.0, 1.0])]
    summary = rollout_summary(groups, [np.array([0, 0]), np.array([1, 3])], max_staleness=2)
    assert summary["reward/mean"] == pytest.approx(0.75)
    assert summary["reward/std"] == pytest.approx(np.std([1.0, 0.0, 1.0, 1.0]))
    assert summary["staleness/mean"] == pytest.approx(1.0) and summary["staleness/max"] == 3
    assert [summary[f"staleness/frac_{k}"] for k in range(3)] == [0.5, 0.25, 0.0]
    assert summary["staleness/frac_over"] == 0.25
    assert summary["perf/completion_tokens"] == 7 and summary["perf/tokens"] == 7 + 4 * 2 + 6 * 2
    assert summary["perf/samples"] == 4 and summary["perf/groups"] == 2
