"""Multi-turn episodes under a Qwen3-style chat template, which rewrites earlier turns: token-exact all the same.

The template (tests/fixtures/thinking_chat_template.jinja, the project's own, imitating Qwen3's documented
behaviour) renders an assistant turn after the last user message with a `<think>...</think>` block and strips the
reasoning of earlier ones, so rendering [user, assistant] and [user, assistant, user] differ in the assistant's part:
the prefix-stable delta of actors.environments.chat_turns cannot be used, and the delta is found in the text after the anchor's
closer. Here SmolLM2's tokenizer (ChatML tokens, which the template writes too) carries that template, and a policy
engine answers with think blocks through the real episode driver. Checked: the template does rewrite earlier turns;
the trajectory is the prompt, then each turn's sampled tokens exactly as sampled, then the rendered delta; each delta
decodes to the template's user/tool turn and its generation prompt (with enable_thinking=false: the empty think block).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from actors.environments.chat_turns import ChatTurnRenderer
from actors.environments.episodes import EpisodeDriver, EpisodeLimits
from actors.environments.runner import EnvRunner
from actors.environments.trajectory import build_episode_group
from common.chat_format import ChatFormat
from common.envs import StepResult
from common.types import PromptItem
from launch.testing import drive_until_done
from tests.actors.env_fakes import PolicyEngine, ScriptedFactory

THINKING = Path(__file__).parent.parent / "fixtures" / "thinking_chat_template.jinja"
TASK = PromptItem(prompt_id=3, epoch=0, messages=[{"role": "user", "content": "Guess my number (1-9)."}], metadata={})
EMPTY_THINK = "<think>\n\n</think>\n\n"


class ToolThenUserEnv:
    """Answers the first turn as a tool (the template wraps it in <tool_response> inside a user turn), the second as a
    user, and ends on the third."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.observations: list[list[dict[str, str]]] = []

    def reset(self, task: PromptItem) -> list[dict[str, str]]:
        return list(task.messages)

    def step(self, text: str) -> StepResult:
        self.texts.append(text)
        turn = len(self.texts)
        if turn == 3:
            return StepResult([], reward=1.0, done=True)
        observation = (
            [{"role": "tool", "content": "lookup: 7"}] if turn == 1 else [{"role": "user", "content": "Higher."}]
        )
        self.observations.append(observation)
        return StepResult(observation, reward=0.0)


def thinking_policy(conversation: str) -> str:
    """A reply with a reasoning block that changes every turn (so that stripping it would show)."""
    turn = conversation.count("<|im_start|>assistant")
    return f"<think>\nturn {turn}: the number is odd\n</think>\n\nI guess {2 * turn + 1}."


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_the_template_strips_the_reasoning_of_earlier_turns_only(tokenizer) -> None:
    """What the episode test relies on: the fixture rewrites an assistant turn once a user message follows it."""
    chat = ChatFormat(THINKING.read_text(), {}, source=str(THINKING))
    reply = {"role": "assistant", "content": "<think>\nit is odd\n</think>\n\nI guess 3."}
    question = {"role": "user", "content": "Guess."}
    system = {"role": "system", "content": "Be brief."}
    last = chat.render_text(tokenizer, [system, question, reply], generation_prompt=False)
    assert last == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nGuess.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nit is odd\n</think>\n\nI guess 3.<|im_end|>\n"
    )
    field = {"role": "assistant", "content": "I guess 3.", "reasoning_content": "it is odd"}
    assert chat.render_text(tokenizer, [system, question, field], generation_prompt=False) == last
    earlier = chat.render_text(tokenizer, [question, reply, {"role": "user", "content": "Higher."}], True)
    assert earlier == (
        "<|im_start|>user\nGuess.<|im_end|>\n<|im_start|>assistant\nI guess 3.<|im_end|>\n"
        "<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"
    )
    tools = [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
    assert chat.render_text(tokenizer, [question, reply, *tools], generation_prompt=False).endswith(
        "I guess 3.<|im_end|>\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
        "</tool_response><|im_end|>\n"
    )  # tool results are no user message: the reply keeps its reasoning, both results share one user turn


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["thinking", "enable_thinking_false"])
def test_qwen3_episode_is_token_exact(tokenizer, kwargs) -> None:
    chat = ChatFormat(THINKING.read_text(), kwargs, source=str(THINKING))
    engine = PolicyEngine(tokenizer, thinking_policy)
    engine.chat = chat
    generation_prompt = "<|im_start|>assistant\n" + (EMPTY_THINK if kwargs else "")
    anchor = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    before = chat.render_ids(tokenizer, anchor, generation_prompt=False)
    after = chat.render_ids(tokenizer, [*anchor, {"role": "user", "content": "z"}], generation_prompt=True)
    assert after[: len(before)] != before, "the template must rewrite the earlier assistant turn here"

    env = ToolThenUserEnv()
    limits = EpisodeLimits(
        max_turns=8,
        max_total_tokens=4096,
        turn_max_tokens=64,
        max_model_len=8192,
        step_timeout_s=5.0,
        episode_timeout_s=30.0,
        failure_reward=-1.0,
    )
    runner = EnvRunner(workers=2)
    try:
        driver = EpisodeDriver(engine, ScriptedFactory([env]), limits, runner, group_size=1)
        driver.start_group(lease_id=1, prompt=TASK)
        (group,) = drive_until_done(driver, timeout_s=30)
    finally:
        runner.close()
    built = build_episode_group(group.lease_id, group.prompt, group.results, generator_id=0, started_at=0.0)
    built.validate()

    prompt = built.prompt_tokens.tolist()
    assert tokenizer.decode(prompt) == f"<|im_start|>user\n{TASK.messages[0]['content']}<|im_end|>\n{generation_prompt}"
    requests = sorted(engine.requests.values(), key=lambda r: int(r.request_id.rsplit(":", 1)[1]))
    assert len(requests) == 3 and env.texts == [engine.decode(np.asarray(r.tokens)) for r in requests]
    assert all("<think>" in tokenizer.decode(r.tokens) for r in requests)  # the sampled turns carry think blocks

    expected, mask = list(prompt), []
    deltas = [
        "<|im_start|>user\n<tool_response>\nlookup: 7\n</tool_response><|im_end|>\n",
        "<|im_start|>user\nHigher.<|im_end|>\n",
    ]
    for turn, request in enumerate(requests):
        assert request.prompt == expected, f"turn {turn} was sampled on something other than the trajectory so far"
        expected += request.tokens  # exactly as sampled: never re-tokenized
        mask += [1] * len(request.tokens)
        if turn < 2:
            delta = ChatTurnRenderer(tokenizer, chat).render_turn(np.asarray(request.tokens), env.observations[turn])
            # the model stopped on <|im_end|> (PolicyEngine ends every turn with it): the closer's rest is "\n"
            assert tokenizer.decode(delta) == "\n" + deltas[turn] + generation_prompt
            expected += delta
            mask += [0] * len(delta)
    assert built.prompt_tokens.tolist() + built.completion_tokens.tolist() == expected
    assert built.loss_mask.tolist() == mask
    assert built.rewards.tolist() == [1.0]
