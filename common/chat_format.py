"""How every stage renders a chat: one chat template (the tokenizer's own, a Jinja file, or none) and its keyword
arguments, from `[model]` chat_template / chat_template_kwargs.

    chat = chat_format(config.model)                     # ValueError: a missing or unreadable template file
    chat.check(tokenizer)                                # ValueError, one line: the template fails to render
    ids = chat.render_prompt(tokenizer, messages)        # what the generator samples from (generation prompt on)
    text = chat.render_text(tokenizer, messages, generation_prompt=False)

Every stage that turns messages into tokens takes them from here, applied to its own tokenizer: RL prompts and
multi-turn deltas (`actors.environments.chat_turns`, through the engine), evaluation (in-run and `tandem eval`, the same engine),
the OpenAI endpoint (its requests become an episode's prompt and turns), the SFT/RM/DPO rows
(`learners.offline.data` through `common.chat_tokens`) and the reward model scorer (`actors.rewards.model`): a
separate model with its own tokenizer, which renders with this same format (its own tokenizer's template when
model.chat_template is empty). `tandem rm` trains a reward model on chats rendered so, so it scores what it learned
from; a reward model of another family with its own format needs model.chat_template empty.

The three kinds of `model.chat_template`:
  ""      the tokenizer's own template (`tokenizer.chat_template`); a tokenizer without one is a ValueError.
  a path  a Jinja file (relative paths start at the config file's folder, resolved by `common.config.load_config`),
          rendered by `apply_chat_template(chat_template=...)` exactly as a tokenizer's own would be.
  "none"  no template: the messages' contents joined with "\\n", each assistant message followed by the tokenizer's
          eos token, and the generation prompt is the "\\n" that precedes the next message; the text starts with
          the special tokens the tokenizer's `encode` adds (BOS, where it adds one). What OpenRLHF does with
          `--apply_chat_template` off, written as a template so that every stage (deltas included) treats it alike.
`chat_template_kwargs` go to every `apply_chat_template` call (e.g. `{enable_thinking = false}` for Qwen3).
Importing this module is cheap (no transformers, no jinja2).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

Message = dict[str, Any]
NO_TEMPLATE = "none"
PLAIN_SEPARATOR = "\n"
# "none" as a template: `tandem_prefix` is what the tokenizer's encode adds in front (chat_format.plain_prefix).
PLAIN_TEMPLATE = (
    "{{ tandem_prefix }}{% for message in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ message['content'] }}{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\n' }}{% endif %}"
)
# A chat that every template must render (check, check_template_text): a question, an answer, a question. No
# system message: some templates refuse one (Gemma's raises), and user/assistant alternate (Mistral's demand it).
PROBE_CHAT: list[Message] = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 2 + 4?"},
]


class HasChatSettings(Protocol):
    """`common.config.ModelConfig`, or anything with its two chat fields."""

    chat_template: str
    chat_template_kwargs: dict[str, Any]


@dataclass(frozen=True)
class ChatFormat:
    """A chat template and its keyword arguments. template: Jinja text, None = the tokenizer's own; plain: the
    "none" format (template is then PLAIN_TEMPLATE); source: where the template came from, for error messages."""

    template: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    plain: bool = False
    source: str = "the tokenizer's own chat template"

    def _arguments(self, tokenizer: Any) -> dict[str, Any]:
        if self.template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"{type(tokenizer).__name__} has no chat template: cannot render chats (set model.chat_template to "
                "a Jinja file, or to 'none' for plain text)"
            )
        arguments = dict(self.kwargs)
        if self.template is not None:
            arguments["chat_template"] = self.template
        if self.plain:
            arguments["tandem_prefix"] = plain_prefix(tokenizer)
        return arguments

    def render_text(self, tokenizer: Any, messages: list[Message], generation_prompt: bool) -> str:
        """`messages` rendered as text (special tokens written as text); ValueError when there is no template."""
        arguments = self._arguments(tokenizer)
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **arguments
        )

    def render_ids(self, tokenizer: Any, messages: list[Message], generation_prompt: bool) -> list[int]:
        """`messages` rendered and tokenized as `apply_chat_template(tokenize=True)` does (the whole text at once,
        special tokens parsed, none added)."""
        arguments = self._arguments(tokenizer)
        ids = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False, add_generation_prompt=generation_prompt, **arguments
        )
        return [int(i) for i in ids]

    def render_prompt(self, tokenizer: Any, messages: list[Message]) -> list[int]:
        """The prompt ids a generator samples from: `messages` with the generation prompt."""
        return self.render_ids(tokenizer, messages, generation_prompt=True)

    def check(self, tokenizer: Any) -> None:
        """Render PROBE_CHAT with this tokenizer; ValueError, one line naming model.chat_template and the Jinja
        error, when the template fails (a syntax error, an exception the template raises, an undefined call)."""
        self._arguments(tokenizer)  # a tokenizer without a template of its own: that error, as it is
        try:
            self.render_text(tokenizer, PROBE_CHAT, generation_prompt=True)
        except Exception as error:  # noqa: BLE001 - jinja2 errors and whatever a template itself raises: one line
            raise ValueError(f"model.chat_template ({self.source}) fails to render a chat: {one_line(error)}") from None


TOKENIZER_OWN = ChatFormat()


def one_line(error: BaseException) -> str:
    """`error` as one line: its type, its message's first line, and the template line for a Jinja syntax error."""
    line = getattr(error, "lineno", None)
    where = f" (template line {line})" if line else ""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}{where}: {message}"


def plain_prefix(tokenizer: Any) -> str:
    """The special tokens the tokenizer's `encode` puts in front of a text (BOS where it adds one), as text."""
    ids = tokenizer.encode("", add_special_tokens=True)
    return tokenizer.decode(ids, skip_special_tokens=False) if ids else ""


def template_path(value: str) -> Path | None:
    """The file a `model.chat_template` value names; None for "" and "none"."""
    return None if value in ("", NO_TEMPLATE) else Path(value).expanduser()


def chat_format(model: HasChatSettings) -> ChatFormat:
    """The format `model.chat_template` / `chat_template_kwargs` describe (module docstring). ValueError, one line
    naming the key, for a template file that is missing or unreadable. Rendering is checked by `ChatFormat.check`
    once a tokenizer is loaded."""
    kwargs = dict(model.chat_template_kwargs)
    if model.chat_template == NO_TEMPLATE:
        return ChatFormat(PLAIN_TEMPLATE, kwargs, plain=True, source="'none': plain text")
    path = template_path(model.chat_template)
    if path is None:
        return ChatFormat(None, kwargs)
    return ChatFormat(read_template(path), kwargs, source=f"'{path}'")


def read_template(path: Path) -> str:
    """The text of a Jinja template file; ValueError naming model.chat_template when it cannot be read."""
    if not path.is_file():
        where = "" if path.is_absolute() else f" (a relative path starts at {Path.cwd()})"
        raise ValueError(
            f"model.chat_template: no such template file '{path}'{where}: name a Jinja file, or leave it empty for the "
            "tokenizer's own template, or 'none' for plain text"
        )
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"model.chat_template: cannot read '{path}': {one_line(error)}") from None


def check_template_text(chat: ChatFormat) -> str | None:
    """Why `chat`'s template fails to render PROBE_CHAT without a tokenizer (transformers' own Jinja renderer, the
    environment `apply_chat_template` uses, with empty special tokens), else None. For `tandem config`, which loads
    no tokenizer; a role checks again with its tokenizer (`ChatFormat.check`). Imports transformers' template
    module (not torch) only when there is a template file to check."""
    if chat.template is None:
        return None
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        render_jinja_template(
            conversations=[PROBE_CHAT],
            chat_template=chat.template,
            add_generation_prompt=True,
            bos_token="",
            eos_token="",
            tandem_prefix="",
            **dict(chat.kwargs),
        )
    except Exception as error:  # noqa: BLE001 - jinja2 errors and whatever a template itself raises: one line
        return f"model.chat_template ({chat.source}) fails to render a chat: {one_line(error)}"
    return None
