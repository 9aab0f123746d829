"""The critic's starting points (learners.models.ValueModel): a policy's backbone with a zero head, or a reward
model's backbone and scalar head (`learner.critic_path`), whose values are then the reward model's scores."""

from __future__ import annotations

from pathlib import Path

import torch

from learners.models import ValueModel, is_reward_model


def _reward_model_dir(policy_dir: Path, out: Path) -> Path:
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        str(policy_dir), num_labels=1, dtype=torch.float32, local_files_only=True
    )
    model.config.pad_token_id = 0
    torch.nn.init.normal_(model.score.weight, std=0.5)  # a head that is not zero, so copying it shows
    model.save_pretrained(str(out))
    return out


def test_a_policy_gives_a_zero_head(tiny_model_dir: Path) -> None:
    critic = ValueModel.from_pretrained(tiny_model_dir, torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    values = critic(ids, torch.ones_like(ids), torch.arange(4)[None], values_to_keep=4)
    assert torch.equal(values, torch.zeros(1, 4))


def test_a_reward_model_gives_its_scores_as_values(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    rm_dir = _reward_model_dir(tiny_model_dir, tmp_path / "rm")
    assert is_reward_model(AutoConfig.from_pretrained(str(rm_dir)))
    assert not is_reward_model(AutoConfig.from_pretrained(str(tiny_model_dir)))
    critic = ValueModel.from_pretrained(rm_dir, torch.float32).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(str(rm_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        values = critic(ids, torch.ones_like(ids), torch.arange(5)[None], values_to_keep=5)  # [1, 5]
        score = rm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, 0]  # the last token's logit
    # The same weights, the same float32 operations on the same input (one row, no padding): equal to rounding of
    # the head's dot product over the hidden size, a few ulps of a value of order 1; 1e-5 is ~100 ulps of it.
    assert abs(float(values[0, -1]) - float(score)) < 1e-5
    assert float(values.abs().sum()) > 0
