"""Token ids of the environment's side of a multi-turn chat, rendered as a DELTA after the model's sampled tokens.

The model's own tokens are never re-tokenised: what it sampled stays exactly as sampled. After its turn the
episode appends, as environment tokens,

    closer  what the chat template writes after an assistant message's content. ChatML (SmolLM2): `<|im_end|>\\n`.
            If the model's last sampled token is the closer's first token (it stopped on `<|im_end|>`), only the
            rest (`\\n`) is appended, so the end-of-turn token is present exactly once.
    delta   the new messages and the generation prompt,
            e.g. `<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`.

How the delta is found, for any template that renders a conversation as a prefix-stable concatenation of turns
(ChatML is one): render an anchor conversation A = [user "x", assistant "y"] without a generation prompt, and
B = A + new messages with the generation prompt; the delta is B[len(A):]. The closer is the text A has after the
anchor assistant content. Both are checked at construction and on every call: B must start with A's tokens and A
must end with the closer's tokens, else ValueError (the template rewrites earlier turns, e.g. strips reasoning;
such templates need their own renderer). The anchor makes the template add what it adds to any conversation
(SmolLM2's default system prompt) to A and B alike, so it cancels out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from common.envs import Message
from common.tasks import render_prompt
from common.types import PromptItem

_ANCHOR_USER = "x"
_ANCHOR_ASSISTANT = "y"


class ChatTurnRenderer:
    """Renders observations after a model turn for one tokenizer (see the module docstring). Stateless per call."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{type(tokenizer).__name__} has no chat template: cannot render multi-turn episodes")
        self.tokenizer = tokenizer
        self._anchor = [
            {"role": "user", "content": _ANCHOR_USER},
            {"role": "assistant", "content": _ANCHOR_ASSISTANT},
        ]
        self._anchor_ids = self._apply(self._anchor, add_generation_prompt=False)
        self.closer = self._find_closer()

    def _apply(self, messages: list[Message], add_generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        return [int(i) for i in ids]

    def _find_closer(self) -> list[int]:
        text = self.tokenizer.apply_chat_template(self._anchor, add_generation_prompt=False, tokenize=False)
        closer_text = text[text.rindex(_ANCHOR_ASSISTANT) + len(_ANCHOR_ASSISTANT) :]
        closer = [int(i) for i in self.tokenizer.encode(closer_text, add_special_tokens=False)]
        if not closer or self._anchor_ids[-len(closer) :] != closer:
            raise ValueError(
                f"chat template: the text after an assistant message ({closer_text!r}) does not tokenize to the "
                "end of the rendered chat; this template needs its own turn renderer"
            )
        return closer

    def render_turn(self, model_tokens: np.ndarray, messages: list[Message]) -> list[int]:
        """Environment tokens that follow the model's turn `model_tokens`: the closer (minus the token the model
        already sampled) + `messages` + the generation prompt. Raises ValueError if the template is not
        prefix-stable for these messages."""
        ended = len(model_tokens) > 0 and int(model_tokens[-1]) == self.closer[0]
        closer = self.closer[1:] if ended else self.closer
        full = self._apply(self._anchor + list(messages), add_generation_prompt=True)
        if full[: len(self._anchor_ids)] != self._anchor_ids:
            raise ValueError(
                "chat template: rendering new messages changed the tokens of earlier turns; "
                "this template needs its own turn renderer"
            )
        return closer + full[len(self._anchor_ids) :]

    def end_of_turn_id(self) -> int:
        """The token that ends an assistant turn (ChatML: `<|im_end|>`): the closer's first token."""
        return self.closer[0]


class TokenizerTexts:
    """The `Engine` interface's text methods for an engine that holds a Hugging Face tokenizer in `self.tokenizer`:
    prompts through its chat template, completions decoded without special tokens, the environment's turns through
    a `ChatTurnRenderer` (made on first use: single-turn runs never need it)."""

    tokenizer: Any
    _turns: ChatTurnRenderer | None = None

    @property
    def turns(self) -> ChatTurnRenderer:
        if self._turns is None:
            self._turns = ChatTurnRenderer(self.tokenizer)
        return self._turns

    def render(self, prompt: PromptItem) -> list[int]:
        return render_prompt(self.tokenizer, prompt)

    def decode(self, tokens: np.ndarray) -> str:
        return self.tokenizer.decode(tokens.tolist(), skip_special_tokens=True)

    def render_turn(self, model_tokens: np.ndarray, messages: list[Message]) -> list[int]:
        return self.turns.render_turn(model_tokens, messages)
