"""A reply's tokens after its prompt, through the chat template: what the offline stages train on
(`learners.offline.data`) and what the reward model scores (`actors.rewards.model`) must be the same tokens, so both
take them from here.

    prompt_ids = render_prompt(tokenizer, PromptRecord(0, prompt), chat)  # common.tasks: what the generator samples
    reply = reply_ids(tokenizer, prompt, [{"role": "assistant", "content": text}], chat=chat)
    prompt_ids + reply                                                 # the chat as the template renders it whole

The reply's ids are the text the template appends to the prompt's rendering (with the generation prompt) when the
whole chat is rendered (without it), tokenized on its own, as a generator's samples follow the prompt's tokens
(tokenizing the whole text at once can merge tokens across the boundary). That needs a template that renders
prefix-stably (adding messages leaves the earlier text unchanged); one that does not is a ValueError saying where.
`chat` (common.chat_format: model.chat_template and its kwargs) is the tokenizer's own template unless given.
"""

from __future__ import annotations

from typing import Any

from common.chat_format import TOKENIZER_OWN, ChatFormat

Message = dict[str, str]


def render_text(
    tokenizer: Any, messages: list[Message], generation_prompt: bool, chat: ChatFormat = TOKENIZER_OWN
) -> str:
    """`messages` through the chat template (`chat`: model.chat_template and its kwargs, default the tokenizer's
    own), as text; ValueError when there is no chat template."""
    return chat.render_text(tokenizer, messages, generation_prompt)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a piece of rendered text, special tokens written in it parsed as such, none added."""
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def appended_text(before: str, after: str, what: str) -> str:
    """The text `after` adds to `before`; ValueError (naming `what` and where the texts part) when `after` does not
    start with `before`."""
    if after.startswith(before):
        return after[len(before) :]
    at = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), min(len(before), len(after)))
    raise ValueError(
        f"the chat template does not render prefix-stably: {what} rewrites the text rendered before it (from "
        f"character {at}: {before[at : at + 40]!r} became {after[at : at + 40]!r}), so the assistant's tokens cannot "
        "be found; use a template that renders earlier turns unchanged (ChatML, e.g. SmolLM2's)"
    )


def reply_ids(
    tokenizer: Any,
    prompt: list[Message],
    reply: list[Message],
    what: str = "the reply",
    chat: ChatFormat = TOKENIZER_OWN,
) -> list[int]:
    """The ids the template (`chat`) appends to `prompt` for `reply` (module docstring): its content, end of turn
    and whatever the template writes after it. ValueError for a template that is missing or not prefix-stable."""
    before = render_text(tokenizer, prompt, generation_prompt=True, chat=chat)
    whole = render_text(tokenizer, prompt + reply, generation_prompt=False, chat=chat)
    return encode_text(tokenizer, appended_text(before, whole, what))
