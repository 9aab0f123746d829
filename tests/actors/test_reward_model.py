"""The learned reward model's scorer (actors/rewards/model.py): pooling, batching, normalisation, truncation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from actors.rewards.model import RewardModelScorer, RunningNorm
from tests.actors.reward_models import make_tiny_reward_model

PROMPT = [{"role": "user", "content": "What is 3 + 4? End with '#### <answer>'."}]
COMPLETIONS = ["3 + 4 = 7\n#### 7", "8", "the answer is surely eight, as anyone can see " * 4, "#### 7", ""]
# Float32 scores of a batch and of one row alone differ only by the order kernels sum in (padded widths change
# the blocking of the GEMMs and the attention softmax's reduction length; causal masking keeps every real
# position's inputs identical). Each reordered sum is off by a few ulps of its terms (2^-24 = 6e-8 relative);
# through 2 layers of <= 128-term sums the score (|s| ~ 0.2 here) stays within ~100 ulps: 1e-5 is that, with margin.
BATCH_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_reward_model(tiny_model_dir, tmp_path_factory.mktemp("rm") / "tiny-rm", seed=1)


def test_batched_scores_equal_one_by_one_scores(rm_dir: Path):
    batched = RewardModelScorer(rm_dir, "float32", batch_size=4, max_len=512, normalize=False)
    alone = RewardModelScorer(rm_dir, "float32", batch_size=1, max_len=512, normalize=False)
    together = batched.score_group(PROMPT, COMPLETIONS)  # 5 rows: a batch of 4 and one of 1, unequal lengths
    one_by_one = [alone.score_group(PROMPT, [text])[0] for text in COMPLETIONS]
    assert together == pytest.approx(one_by_one, abs=BATCH_TOLERANCE, rel=0)
    assert len(set(together)) == len(together)  # the completions are told apart: the scores are not constant
    assert batched.scored == len(COMPLETIONS) and batched.truncated == 0


def test_the_scored_tokens_are_the_ones_tandem_rm_trains_on(rm_dir: Path):
    from learners.offline.data import tokenize_pair

    scorer = RewardModelScorer(rm_dir, "float32", batch_size=8, max_len=512, normalize=False)
    chosen, rejected = ({"role": "assistant", "content": text} for text in COMPLETIONS[:2])
    pair = tokenize_pair(scorer.tokenizer, PROMPT, [chosen], [rejected], max_len=512)
    assert scorer.tokenize([*PROMPT, chosen]) == pair.prompt_ids + pair.chosen_ids
    assert scorer.tokenize([*PROMPT, rejected]) == pair.prompt_ids + pair.rejected_ids
    with pytest.raises(ValueError, match="assistant"):
        scorer.tokenize(PROMPT)


def test_the_score_is_the_head_on_the_last_token(rm_dir: Path):
    import torch

    scorer = RewardModelScorer(rm_dir, "float32", batch_size=8, max_len=512, normalize=False)
    chat = [*PROMPT, {"role": "assistant", "content": COMPLETIONS[0]}]
    ids = scorer.tokenize(chat)
    base = getattr(scorer.model, scorer.model.base_model_prefix)
    with torch.inference_mode():  # no padding, no pooling: the head on the last position's hidden state
        hidden = base(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        expected = float(scorer.model.score(hidden)[0])
    assert scorer.score_chats([chat])[0] == pytest.approx(expected, abs=BATCH_TOLERANCE, rel=0)


def test_running_normalisation_against_hand_worked_numbers():
    norm = RunningNorm()
    # 1: mean 1, std 0 -> 0.  3: mean 2, var (1 + 1) / 2 = 1 -> (3 - 2) / 1 = 1.
    # 2: mean 2, var (1 + 1 + 0) / 3 -> 0.  6: mean 3, var (4 + 0 + 1 + 9) / 4 = 3.5 -> 3 / sqrt(3.5).
    assert [norm.normalize(s) for s in (1.0, 3.0, 2.0, 6.0)] == pytest.approx([0.0, 1.0, 0.0, 3 / math.sqrt(3.5)])
    assert norm.count == 4 and norm.mean == pytest.approx(3.0) and norm.std == pytest.approx(math.sqrt(3.5))


def test_a_normalising_scorer_normalises_its_raw_scores_in_order(rm_dir: Path):
    raw = RewardModelScorer(rm_dir, "float32", batch_size=8, max_len=512, normalize=False)
    normalising = RewardModelScorer(rm_dir, "float32", batch_size=8, max_len=512, normalize=True)
    norm = RunningNorm()
    for texts in (COMPLETIONS[:2], COMPLETIONS[2:]):
        expected = [norm.normalize(s) for s in raw.score_group(PROMPT, texts)]
        assert normalising.score_group(PROMPT, texts) == pytest.approx(expected, abs=1e-9)
    assert normalising.norm.count == len(COMPLETIONS)


def test_a_long_chat_keeps_its_last_max_len_tokens(rm_dir: Path):
    scorer = RewardModelScorer(rm_dir, "float32", batch_size=2, max_len=16, normalize=False)
    chat = [*PROMPT, {"role": "assistant", "content": COMPLETIONS[2]}]
    full = RewardModelScorer(rm_dir, "float32", batch_size=2, max_len=4096, normalize=False).tokenize(chat)
    assert scorer.tokenize(chat) == full[-16:] and scorer.truncated == 1


def test_a_model_with_more_than_one_label_is_refused(tiny_model_dir: Path, tmp_path: Path):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels = 2
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="2 labels"):
        RewardModelScorer(tmp_path, "float32", batch_size=2, max_len=64, normalize=False)


def test_a_directory_without_a_model_names_the_key(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="env.reward_model"):
        RewardModelScorer(tmp_path, "float32", batch_size=2, max_len=64, normalize=False)
