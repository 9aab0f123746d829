"""Token ids of the environment's side of a multi-turn chat, rendered as a DELTA after the model's sampled tokens.

The model's own tokens are never re-tokenised: what it sampled stays exactly as sampled, and what it is trained on
equals what it was sampled on. After its turn the episode appends, as environment tokens,

    closer  what the chat template writes after an assistant message's content. ChatML (SmolLM2): `<|im_end|>\\n`.
            If the model's last sampled token is the closer's first token (it stopped on `<|im_end|>`), only the
            rest (`\\n`) is appended, so the end-of-turn token is present exactly once.
    delta   the new messages and the generation prompt,
            e.g. `<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`.

All rendering goes through one `common.chat_format.ChatFormat` (model.chat_template and its kwargs).

How the delta is found. Render an anchor conversation A = [user "x", assistant "y"] without a generation prompt, and
B = A + new messages with the generation prompt. The closer is the text A has after the anchor assistant content
(checked at construction: A's tokens end with the closer's tokens).
  * Prefix-stable templates (ChatML is one): B's tokens start with A's, and the delta is B[len(A):] in tokens.
    The anchor makes the template add what it adds to any conversation (SmolLM2's default system prompt) to A and
    B alike, so it cancels out.
  * Templates that rewrite earlier turns (Qwen3's: an assistant turn after the last user message gets a
    `<think>...</think>` block, earlier ones have their reasoning stripped, so A's assistant part changes once a
    user message follows it): B's tokens do not start with A's. Then the delta is taken from B's TEXT: with a
    distinctive anchor content (`_TEXT_ANCHOR`, which must occur exactly once in B), the closer must follow it, and
    the delta is everything after that closer, tokenized on its own. What the template did to the history is
    discarded: the trajectory keeps the model's own tokens (think blocks included), as TRL trains with a template
    that keeps the history. So the model is trained on the context it was sampled in, which is not what the
    template would render for the whole chat from scratch (there, earlier reasoning is stripped); a delta that the
    template makes depend on the earlier turns' content is rendered for the anchor, not for them.
Either way a rendering that breaks these checks is a ValueError saying which.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from common.chat_format import TOKENIZER_OWN, ChatFormat
from common.envs import Message
from common.types import PromptItem

_ANCHOR_USER = "x"
_ANCHOR_ASSISTANT = "y"
_TEXT_ANCHOR = "tandem-anchor-7c1e9"  # the anchor content when the delta is found in text: unique in any rendering


class ChatTurnRenderer:
    """Renders observations after a model turn for one tokenizer and chat format (see the module docstring).
    Stateless per call."""

    def __init__(self, tokenizer: Any, chat: ChatFormat = TOKENIZER_OWN) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self._anchor = [
            {"role": "user", "content": _ANCHOR_USER},
            {"role": "assistant", "content": _ANCHOR_ASSISTANT},
        ]
        self._anchor_ids = self._apply(self._anchor, add_generation_prompt=False)
        self._closer_text, self.closer = self._find_closer()

    def _apply(self, messages: list[Message], add_generation_prompt: bool) -> list[int]:
        return self.chat.render_ids(self.tokenizer, messages, generation_prompt=add_generation_prompt)

    def _find_closer(self) -> tuple[str, list[int]]:
        text = self.chat.render_text(self.tokenizer, self._anchor, generation_prompt=False)
        closer_text = text[text.rindex(_ANCHOR_ASSISTANT) + len(_ANCHOR_ASSISTANT) :]
        closer = [int(i) for i in self.tokenizer.encode(closer_text, add_special_tokens=False)]
        if not closer or self._anchor_ids[-len(closer) :] != closer:
            raise ValueError(
                f"chat template: the text after an assistant message ({closer_text!r}) does not tokenize to the "
                "end of the rendered chat; this template needs its own turn renderer"
            )
        return closer_text, closer

    def render_turn(self, model_tokens: np.ndarray, messages: list[Message]) -> list[int]:
        """Environment tokens that follow the model's turn `model_tokens`: the closer (minus the token the model
        already sampled) + `messages` + the generation prompt. Raises ValueError when neither way of the module
        docstring finds the delta for these messages."""
        ended = len(model_tokens) > 0 and int(model_tokens[-1]) == self.closer[0]
        closer = self.closer[1:] if ended else self.closer
        full = self._apply(self._anchor + list(messages), add_generation_prompt=True)
        if full[: len(self._anchor_ids)] == self._anchor_ids:
            return closer + full[len(self._anchor_ids) :]
        return closer + self._text_delta(list(messages))

    def _text_delta(self, messages: list[Message]) -> list[int]:
        """The delta of a template that rewrote the anchor's turns: the text after the anchor content's closer."""
        anchor = [self._anchor[0], {"role": "assistant", "content": _TEXT_ANCHOR}]
        text = self.chat.render_text(self.tokenizer, anchor + messages, generation_prompt=True)
        if text.count(_TEXT_ANCHOR) != 1:
            raise ValueError(
                f"chat template: the anchor assistant content appears {text.count(_TEXT_ANCHOR)} times in the "
                "rendered chat, not once, so the new messages cannot be told from the earlier turns"
            )
        after = text[text.index(_TEXT_ANCHOR) + len(_TEXT_ANCHOR) :]
        if not after.startswith(self._closer_text):
            raise ValueError(
                f"chat template: an assistant message followed by new messages ends with {after[:40]!r}, not with "
                f"the closer {self._closer_text!r} it ends the last turn with; this template needs its own turn "
                "renderer"
            )
        return [int(i) for i in self.tokenizer.encode(after[len(self._closer_text) :], add_special_tokens=False)]

    def end_of_turn_id(self) -> int:
        """The token that ends an assistant turn (ChatML: `<|im_end|>`): the closer's first token."""
        return self.closer[0]


class TokenizerTexts:
    """The `Engine` interface's text methods for an engine that holds a Hugging Face tokenizer in `self.tokenizer`
    and the run's chat format in `self.chat` (model.chat_template; the tokenizer's own when not set): prompts through
    it, completions decoded without special tokens, the environment's turns through a `ChatTurnRenderer` (made on
    first use: single-turn runs never need it)."""

    tokenizer: Any
    chat: ChatFormat = TOKENIZER_OWN
    _turns: ChatTurnRenderer | None = None

    @property
    def turns(self) -> ChatTurnRenderer:
        if self._turns is None:
            self._turns = ChatTurnRenderer(self.tokenizer, self.chat)
        return self._turns

    def render(self, prompt: PromptItem) -> list[int]:
        return self.chat.render_prompt(self.tokenizer, prompt.messages)

    def decode(self, tokens: np.ndarray) -> str:
        return self.tokenizer.decode(tokens.tolist(), skip_special_tokens=True)

    def render_turn(self, model_tokens: np.ndarray, messages: list[Message]) -> list[int]:
        return self.turns.render_turn(model_tokens, messages)
