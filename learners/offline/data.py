"""Rows and tokens of the offline stages (`tandem sft`, `tandem rm`, `tandem dpo`): pure functions, no engine.

    chats = chat_rows("chats.jsonl", cfg.sft)                           # list of chats (lists of messages)
    example = tokenize_chat(tokenizer, chats[0], max_len)               # ids + loss mask on assistant tokens
    pairs = preference_rows("pairs.jsonl", cfg.rm)                      # PreferenceRow(prompt, chosen, rejected)
    pair = tokenize_pair(tokenizer, p.prompt, p.chosen, p.rejected, max_len)
    ids, attention = pad_right([example.input_ids, ...], pad_id)        # [B, L] long, [B, L] bool

Everything is rendered through the tokenizer's chat template, the way the generator renders prompts
(`common.tasks.render_prompt`: the chat, then the assistant generation prompt), so that what the offline stages train
on is token for token what the RL loop samples from. The assistant's tokens are found by rendering the chat's prefixes
and taking the differences of the texts; that needs a template that renders prefix-stably (rendering more messages
only appends text: ChatML templates such as SmolLM2's do). One that rewrites earlier turns is refused.

Row shapes (keys from the stage's config section; a null value counts as absent, as parquet fills missing columns):
    SFT          {messages: chat with >= 1 assistant turn}  or  {prompt: text | messages, completion: text | messages}
    preference   {prompt: text | messages, chosen: text | messages, rejected: text | messages}   (TRL)
                 {messages: prompt messages, chosen, rejected}                                   (prompt as a chat)
                 {chosen: whole chat, rejected: whole chat}         (OpenRLHF, TRL's implicit prompt: the common
                                                                     first messages are the prompt, the rest the reply)
A text prompt is one user message, a text reply one assistant message. Messages keep only `role` and `content`.
A malformed row is a ValueError naming the file and line (jsonl) or row (parquet, datasets) and what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.chat_format import TOKENIZER_OWN, ChatFormat
from common.chat_tokens import appended_text, encode_text, render_text, reply_ids
from common.config import RmConfig, SftConfig
from common.padding import pad_right
from common.tasks import PromptRecord, read_rows, render_prompt

__all__ = [
    "ChatExample",
    "PairExample",
    "PreferenceRow",
    "chat_from_row",
    "chat_rows",
    "pad_right",
    "preference_from_row",
    "preference_rows",
    "tokenize_chat",
    "tokenize_pair",
]

Message = dict[str, str]


@dataclass(frozen=True)
class ChatExample:
    """One SFT chat as tokens. input_ids: the chat rendered by the template up to the end of its last assistant turn
    (its first tokens are exactly `render_prompt` of the messages before the first assistant turn);
    loss_mask: same length, True on each assistant turn's content and end-of-turn token (through the tokenizer's
    eos), False on system/user turns, the template's role headers and separators. truncated: the chat was longer than
    max_len and lost its last tokens."""

    input_ids: list[int]
    loss_mask: list[bool]
    truncated: bool = False


@dataclass(frozen=True)
class PairExample:
    """One preference pair as tokens. prompt_ids: exactly `render_prompt(prompt)` (generation prompt included);
    chosen_ids / rejected_ids: the tokens the template appends for each reply (content, end of turn and the
    template's separator after it: prompt_ids + chosen_ids renders the whole chat as `apply_chat_template` does).
    truncated: a reply was cut to fit max_len."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    truncated: bool = False


@dataclass(frozen=True)
class PreferenceRow:
    """A pair as messages: prompt (>= 1 message), chosen and rejected (each >= 1 message, first and last assistant)."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]


# ------------------------------------------------------------------------------------------- tokens


def _reply_mask(tokenizer: Any, reply: list[int]) -> list[bool]:
    """True through the reply's last eos token (content + end of turn); the template's separator after it is not
    trained. A reply without the eos token (a template that ends turns otherwise) is trained whole."""
    eos = tokenizer.eos_token_id
    ends = [i for i, token in enumerate(reply) if token == eos]
    cut = ends[-1] + 1 if ends else len(reply)
    return [i < cut for i in range(len(reply))]


def tokenize_chat(
    tokenizer: Any, messages: list[dict], max_len: int, chat_format: ChatFormat = TOKENIZER_OWN
) -> ChatExample:
    """The chat as tokens with the loss on the assistant's tokens only (see ChatExample), rendered by
    `chat_format` (model.chat_template and its kwargs; default the tokenizer's own template).

    For each assistant turn i the template renders messages[:i] with the generation prompt and messages[:i + 1]
    without; the text between the two is the turn (content, end of turn, separator), the text before the prompt's
    part. Messages after the last assistant turn are left out (nothing to train on). Rows longer than max_len are
    cut to their first max_len tokens (truncated=True). Raises ValueError when the chat has no assistant turn,
    starts with one (no prompt before it), the template does not render prefix-stably, or max_len leaves no
    assistant token.
    """
    chat = _checked_messages(messages, "the chat")
    turns = [i for i, message in enumerate(chat) if message["role"] == "assistant"]
    if not turns:
        raise ValueError("the chat has no assistant turn: nothing to train on")
    if turns[0] == 0:
        raise ValueError("the chat starts with an assistant turn: it needs a prompt (a user message) before it")
    ids = render_prompt(tokenizer, PromptRecord(0, chat[: turns[0]]), chat_format)
    first_reply, mask = len(ids), [False] * len(ids)
    rendered = render_text(tokenizer, chat[: turns[0]], generation_prompt=True, chat=chat_format)
    for turn in turns:
        if turn != turns[0]:
            prompt = render_text(tokenizer, chat[:turn], generation_prompt=True, chat=chat_format)
            between = encode_text(tokenizer, appended_text(rendered, prompt, f"rendering messages up to {turn}"))
            ids, mask, rendered = ids + between, mask + [False] * len(between), prompt
        replied = render_text(tokenizer, chat[: turn + 1], generation_prompt=False, chat=chat_format)
        reply = encode_text(tokenizer, appended_text(rendered, replied, f"assistant message {turn}"))
        ids, mask, rendered = ids + reply, mask + _reply_mask(tokenizer, reply), replied
    truncated = len(ids) > max_len
    ids, mask = ids[:max_len], mask[:max_len]
    if not any(mask):
        raise ValueError(
            f"max_len {max_len} leaves no assistant token of the chat (the first is at position {first_reply}): "
            "raise max_len or shorten the prompt"
        )
    return ChatExample(input_ids=ids, loss_mask=mask, truncated=truncated)


def tokenize_pair(
    tokenizer: Any,
    prompt: list[dict],
    chosen: list[dict],
    rejected: list[dict],
    max_len: int,
    chat: ChatFormat = TOKENIZER_OWN,
) -> PairExample:
    """The pair as tokens (see PairExample), rendered by `chat` (model.chat_template and its kwargs; default the
    tokenizer's own template): the prompt through `render_prompt`, each reply the text the template
    appends to it when the chat prompt + reply is rendered whole (no generation prompt), tokenized on its own, as
    the generator's samples follow the prompt's tokens. Each reply is cut from the right so that prompt + reply
    fits max_len (truncated=True). Raises ValueError for malformed messages, a reply that does not start with an
    assistant message, a template that does not render prefix-stably, or a prompt that leaves no room in max_len.
    """
    prompt = _checked_messages(prompt, "the prompt")
    prompt_ids = render_prompt(tokenizer, PromptRecord(0, prompt), chat)
    room = max_len - len(prompt_ids)
    if room < 1:
        raise ValueError(
            f"the prompt is {len(prompt_ids)} tokens, max_len {max_len} leaves no room for the replies: raise "
            "max_len or shorten the prompt"
        )
    replies = [
        reply_ids(tokenizer, prompt, _checked_reply(reply, f"the {name} reply"), f"the {name} reply", chat)
        for name, reply in (("chosen", chosen), ("rejected", rejected))
    ]
    truncated = any(len(reply) > room for reply in replies)
    return PairExample(prompt_ids, replies[0][:room], replies[1][:room], truncated)


# --------------------------------------------------------------------------------------------- rows


def _checked_messages(value: Any, what: str) -> list[Message]:
    """A non-empty list of {"role": str, "content": str} (other keys dropped); ValueError naming `what` otherwise."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{what} must be a non-empty list of messages, got {type(value).__name__} {value!r:.80}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or not all(isinstance(message.get(k), str) for k in ("role", "content")):
            raise ValueError(f"{what}: message {i} must have string 'role' and 'content', got {message!r:.80}")
        messages.append({"role": message["role"], "content": message["content"]})
    return messages


def _checked_reply(value: Any, what: str) -> list[Message]:
    """A reply: text (one assistant message) or messages whose first and last are the assistant's."""
    reply = [{"role": "assistant", "content": value}] if isinstance(value, str) else _checked_messages(value, what)
    if reply[0]["role"] != "assistant" or reply[-1]["role"] != "assistant":
        roles = [message["role"] for message in reply]
        raise ValueError(f"{what} must start and end with an assistant message, got roles {roles}")
    return reply


def _prompt(value: Any, what: str) -> list[Message]:
    """A prompt: text (one user message) or messages."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else _checked_messages(value, what)


def _present(row: Mapping[str, Any], *keys: str) -> list[str]:
    return [key for key in keys if row.get(key) is not None]


def chat_from_row(row: Mapping[str, Any], where: str, cfg: SftConfig) -> list[Message]:
    """The chat of one SFT row (shapes in the module docstring); `where` ("file, line N") prefixes every error.
    Raises ValueError for a row with neither or both shapes, malformed messages, or no assistant turn."""
    try:
        if _present(row, cfg.messages_key):
            if _present(row, cfg.prompt_key, cfg.completion_key):
                raise ValueError(f"has {cfg.messages_key!r} and {cfg.prompt_key!r}/{cfg.completion_key!r}: keep one")
            chat = _checked_messages(row[cfg.messages_key], repr(cfg.messages_key))
        elif len(_present(row, cfg.prompt_key, cfg.completion_key)) == 2:
            prompt = _prompt(row[cfg.prompt_key], repr(cfg.prompt_key))
            chat = prompt + _checked_reply(row[cfg.completion_key], repr(cfg.completion_key))
        else:
            raise ValueError(
                f"needs {cfg.messages_key!r} (a chat) or {cfg.prompt_key!r} and {cfg.completion_key!r}, "
                f"got keys {sorted(_present(row, *row))}"
            )
        if not any(message["role"] == "assistant" for message in chat):
            raise ValueError("the chat has no assistant turn: nothing to train on")
        if chat[0]["role"] == "assistant":
            raise ValueError("the chat starts with an assistant turn: it needs a prompt before it")
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    return chat


def _split_whole_chats(chosen: Any, rejected: Any, cfg: RmConfig) -> PreferenceRow:
    """OpenRLHF's shape: two whole chats; their common first messages are the prompt, the rest the replies."""
    if isinstance(chosen, str) or isinstance(rejected, str):
        raise ValueError(
            f"has no {cfg.prompt_key!r} or {cfg.messages_key!r}: {cfg.chosen_key!r} and {cfg.rejected_key!r} must "
            "then be whole chats (lists of messages), not text"
        )
    chosen = _checked_messages(chosen, repr(cfg.chosen_key))
    rejected = _checked_messages(rejected, repr(cfg.rejected_key))
    common = next((i for i, (a, b) in enumerate(zip(chosen, rejected, strict=False)) if a != b), None)
    if common is None:
        raise ValueError(f"{cfg.chosen_key!r} and {cfg.rejected_key!r}: one chat is the other or starts it")
    if common == 0:
        raise ValueError(f"{cfg.chosen_key!r} and {cfg.rejected_key!r} differ from their first message: no prompt")
    return PreferenceRow(
        prompt=chosen[:common],
        chosen=_checked_reply(chosen[common:], f"{cfg.chosen_key!r} after the common prompt"),
        rejected=_checked_reply(rejected[common:], f"{cfg.rejected_key!r} after the common prompt"),
    )


def preference_from_row(row: Mapping[str, Any], where: str, cfg: RmConfig) -> PreferenceRow:
    """The pair of one preference row (shapes in the module docstring); `where` prefixes every error.
    Raises ValueError for a missing chosen/rejected, both prompt keys, malformed messages, replies that do not
    start and end with an assistant message, or whole chats without a common prompt."""
    try:
        missing = [key for key in (cfg.chosen_key, cfg.rejected_key) if row.get(key) is None]
        if missing:
            raise ValueError(
                f"needs {cfg.chosen_key!r} and {cfg.rejected_key!r}, got keys {sorted(_present(row, *row))}"
            )
        prompt_keys = _present(row, cfg.prompt_key, cfg.messages_key)
        if len(prompt_keys) == 2:
            raise ValueError(f"has {cfg.prompt_key!r} and {cfg.messages_key!r}: keep one prompt")
        if not prompt_keys:
            return _split_whole_chats(row[cfg.chosen_key], row[cfg.rejected_key], cfg)
        return PreferenceRow(
            prompt=_prompt(row[prompt_keys[0]], repr(prompt_keys[0])),
            chosen=_checked_reply(row[cfg.chosen_key], repr(cfg.chosen_key)),
            rejected=_checked_reply(row[cfg.rejected_key], repr(cfg.rejected_key)),
        )
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def chat_rows(source: str, cfg: SftConfig) -> list[list[Message]]:
    """Every chat of an SFT file source (jsonl, parquet, `datasets` folder; `common.tasks.read_rows`), in order.
    Raises what read_rows raises, ValueError naming the file and line/row of a malformed row, or for no rows."""
    chats = [chat_from_row(row, where, cfg) for where, row in read_rows(source, what="sft source")]
    if not chats:
        raise ValueError(f"sft source {source!r} has no rows")
    return chats


def preference_rows(source: str, cfg: RmConfig) -> list[PreferenceRow]:
    """Every pair of a preference file source (as `chat_rows`), in order; `cfg` is [rm] or [dpo].
    Raises what read_rows raises, ValueError naming the file and line/row of a malformed row, or for no rows."""
    pairs = [preference_from_row(row, where, cfg) for where, row in read_rows(source, what="preference source")]
    if not pairs:
        raise ValueError(f"preference source {source!r} has no rows")
    return pairs
