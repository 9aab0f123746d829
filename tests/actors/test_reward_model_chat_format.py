"""The reward model scorer renders with the run's chat format (model.chat_template and its kwargs) on its own
tokenizer: the tokens `tandem rm` trained on under that format, not its tokenizer's own template's."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.rewards.model import RewardModelScorer
from common.chat_format import ChatFormat
from learners.offline.data import tokenize_pair
from tests.actors.reward_models import make_tiny_reward_model

THINKING = Path(__file__).parent.parent / "fixtures" / "thinking_chat_template.jinja"
PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]
CHOSEN, REJECTED = [{"role": "assistant", "content": "#### 7"}], [{"role": "assistant", "content": "#### 8"}]


def test_the_scorer_renders_with_the_runs_chat_format(tiny_model_dir: Path, tmp_path: Path) -> None:
    rm_dir = make_tiny_reward_model(tiny_model_dir, tmp_path / "rm", seed=1)
    chat = ChatFormat(THINKING.read_text(), {"enable_thinking": False}, source=str(THINKING))
    scorer = RewardModelScorer(rm_dir, "float32", batch_size=2, max_len=512, normalize=False, chat=chat)
    own = RewardModelScorer(rm_dir, "float32", batch_size=2, max_len=512, normalize=False)
    pair = tokenize_pair(scorer.tokenizer, PROMPT, CHOSEN, REJECTED, max_len=512, chat=chat)  # what tandem rm trains on
    assert scorer.tokenize([*PROMPT, *CHOSEN]) == pair.prompt_ids + pair.chosen_ids
    assert scorer.tokenize([*PROMPT, *REJECTED]) == pair.prompt_ids + pair.rejected_ids
    text = scorer.tokenizer.decode(scorer.tokenize([*PROMPT, *CHOSEN]))
    assert (
        text
        == "<|im_start|>user\nWhat is 3 + 4?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n#### 7<|im_end|>\n"
    )
    assert own.tokenize([*PROMPT, *CHOSEN]) != scorer.tokenize([*PROMPT, *CHOSEN])  # SmolLM2's own: a system prompt
    broken = ChatFormat("{% for m in messages %}", {}, source="'broken.jinja'")
    with pytest.raises(ValueError, match=r"^model.chat_template \('broken.jinja'\) fails to render a chat"):
        RewardModelScorer(rm_dir, "float32", batch_size=2, max_len=512, normalize=False, chat=broken)
