"""model.chat_template / chat_template_kwargs (common.chat_format): the kwargs reach the prompt, an override file is
what every stage renders with (RL prompt, multi-turn, eval, SFT, RM/DPO), "none" renders plain text, and a missing
or broken template is one line at start (and in `tandem config`'s path checks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.environments.chat_turns import TokenizerTexts
from common.chat_format import TOKENIZER_OWN, ChatFormat, chat_format, check_template_text
from common.chat_tokens import reply_ids
from common.config import load_config
from common.tasks import PromptRecord, render_prompt
from common.types import PromptItem
from launch.config_checks import missing_paths
from learners.offline.data import tokenize_chat, tokenize_pair

THINKING = Path(__file__).parent.parent / "fixtures" / "thinking_chat_template.jinja"
# A prefix-stable override unlike ChatML: every stage must render with it once it is configured.
BRACKETS = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}"
    "{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)
QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
ANSWER = [{"role": "assistant", "content": "5"}]


class Texts(TokenizerTexts):
    """The engine side's renderer (what VllmEngine renders prompts, turns and eval prompts with)."""

    def __init__(self, tokenizer: object, chat: ChatFormat) -> None:
        self.tokenizer, self.chat = tokenizer, chat


def test_enable_thinking_false_reaches_the_prompt(smollm2_tokenizer) -> None:
    """The Qwen3-style test template adds the empty think block to the generation prompt only when enable_thinking is false."""
    thinking = ChatFormat(THINKING.read_text(), {})
    not_thinking = ChatFormat(THINKING.read_text(), {"enable_thinking": False})
    record = PromptRecord(0, QUESTION)
    plain = smollm2_tokenizer.decode(render_prompt(smollm2_tokenizer, record, thinking))
    off = smollm2_tokenizer.decode(render_prompt(smollm2_tokenizer, record, not_thinking))
    assert plain.endswith("<|im_start|>assistant\n")
    assert off == plain + "<think>\n\n</think>\n\n"


def test_an_override_file_is_what_every_stage_renders(smollm2_tokenizer, tmp_path: Path) -> None:
    (tmp_path / "templates").mkdir()
    (tmp_path / "templates" / "brackets.jinja").write_text(BRACKETS)
    config_file = tmp_path / "run.toml"
    config_file.write_text('[model]\nchat_template = "templates/brackets.jinja"\n')
    config = load_config(config_file)
    assert config.model.chat_template == str(tmp_path / "templates" / "brackets.jinja")  # from the file's folder
    chat = chat_format(config.model)
    chat.check(smollm2_tokenizer)
    tokenizer = smollm2_tokenizer
    record = PromptRecord(0, QUESTION)
    prompt = render_prompt(tokenizer, record, chat)
    assert tokenizer.decode(prompt) == "[system] Be brief.\n[user] What is 2 + 3?\n[assistant] "
    assert prompt != render_prompt(tokenizer, record)  # not the tokenizer's own ChatML
    # RL prompts and evaluation (the engine's render), and multi-turn deltas
    texts = Texts(tokenizer, chat)
    assert texts.render(PromptItem(0, 0, QUESTION, {})) == prompt
    eos = tokenizer.eos_token
    delta = texts.render_turn(tokenizer.encode("5", add_special_tokens=False), [{"role": "user", "content": "And 3?"}])
    assert tokenizer.decode(delta) == f"{eos}\n[user] And 3?\n[assistant] "
    # SFT: the prompt's tokens, then the reply's with the loss on them
    example = tokenize_chat(tokenizer, QUESTION + ANSWER, max_len=256, chat_format=chat)
    assert example.input_ids[: len(prompt)] == prompt
    assert tokenizer.decode(example.input_ids) == tokenizer.decode(prompt) + f"5{eos}\n"
    # RM / DPO pairs and the reward model scorer's reply ids
    pair = tokenize_pair(tokenizer, QUESTION, ANSWER, [{"role": "assistant", "content": "6"}], 256, chat)
    assert pair.prompt_ids == prompt
    assert pair.chosen_ids == reply_ids(tokenizer, QUESTION, ANSWER, chat=chat)
    assert tokenizer.decode(pair.rejected_ids) == f"6{eos}\n"


def test_none_renders_plain_text(smollm2_tokenizer) -> None:
    config = load_config(None, ["--model.chat_template=none"])
    chat = chat_format(config.model)
    tokenizer = smollm2_tokenizer
    assert tokenizer.encode("", add_special_tokens=True) == []  # SmolLM2 adds no BOS: nothing in front
    prompt = render_prompt(tokenizer, PromptRecord(0, QUESTION), chat)
    assert prompt == tokenizer.encode("Be brief.\nWhat is 2 + 3?\n", add_special_tokens=False)
    assert tokenizer.decode(reply_ids(tokenizer, QUESTION, ANSWER, chat=chat)) == "5" + tokenizer.eos_token
    texts = Texts(tokenizer, chat)  # multi-turn: the model's turn ends on eos, the observation follows as text
    turn = [*tokenizer.encode("5", add_special_tokens=False), tokenizer.eos_token_id]
    assert texts.turns.end_of_turn_id() == tokenizer.eos_token_id
    assert tokenizer.decode(texts.render_turn(turn, [{"role": "user", "content": "And 3?"}])) == "\nAnd 3?\n"


def test_none_puts_the_tokenizers_bos_in_front(smollm2_tokenizer) -> None:
    class WithBos:
        """SmolLM2's tokenizer with a BOS that encode adds (as Llama's does): id 1, `<|im_start|>`, stands in."""

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return ([1] if add_special_tokens else []) + smollm2_tokenizer.encode(text, add_special_tokens=False)

        def __getattr__(self, name: str) -> object:
            return getattr(smollm2_tokenizer, name)

    chat = chat_format(load_config(None, ["--model.chat_template=none"]).model)
    prompt = chat.render_prompt(WithBos(), [{"role": "user", "content": "Hi"}])
    assert prompt == [1, *smollm2_tokenizer.encode("Hi\n", add_special_tokens=False)]


def test_the_tokenizers_own_template_by_default(smollm2_tokenizer) -> None:
    config = load_config(None)
    assert config.model.chat_template == "" and config.model.chat_template_kwargs == {}
    assert chat_format(config.model) == TOKENIZER_OWN
    ids = smollm2_tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert render_prompt(smollm2_tokenizer, PromptRecord(0, QUESTION), TOKENIZER_OWN) == list(ids)


def test_a_missing_template_file_is_one_line(tmp_path: Path) -> None:
    config = load_config(None, [f"--model.chat_template={tmp_path / 'nope.jinja'}", "--model.path=tiny"])
    with pytest.raises(ValueError, match=r"^model.chat_template: no such template file .*nope.jinja"):
        chat_format(config.model)
    (problem,) = [line for line in missing_paths(config, "generator") if "chat_template" in line]
    assert "no such template file" in problem and "\n" not in problem
    assert [line for line in missing_paths(config, "buffer") if "chat_template" in line] == []  # renders nothing


def test_a_broken_template_is_one_line(smollm2_tokenizer, tmp_path: Path) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor\n")  # the endfor is never closed
    config = load_config(None, [f"--model.chat_template={broken}", "--model.path=tiny"])
    chat = chat_format(config.model)
    with pytest.raises(ValueError, match=r"^model.chat_template \(.*broken.jinja'\) fails to render a chat: Template"):
        chat.check(smollm2_tokenizer)
    problem = check_template_text(chat)
    assert problem is not None and "TemplateSyntaxError" in problem and "\n" not in problem
    assert [line for line in missing_paths(config, "sft") if "chat_template" in line] == [problem]
    raising = ChatFormat("{{ raise_exception('only user turns') }}", {}, source="'raising.jinja'")
    with pytest.raises(ValueError, match="fails to render a chat: .*only user turns"):
        raising.check(smollm2_tokenizer)
    assert "only user turns" in (check_template_text(raising) or "")
    assert check_template_text(ChatFormat(THINKING.read_text(), {"enable_thinking": False})) is None


def test_kwargs_come_from_a_toml_table_and_templates_check_as_transformers_renders(tmp_path: Path) -> None:
    config_file = tmp_path / "run.toml"
    config_file.write_text('[model]\nchat_template = "none"\nchat_template_kwargs = {enable_thinking = false}\n')
    config = load_config(config_file)
    assert config.model.chat_template == "none"  # not a path: left as written
    assert chat_format(config.model).kwargs == {"enable_thinking": False}
    # transformers' own extensions and globals: a training template's {% generation %} block, strftime_now
    training = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    assert check_template_text(ChatFormat(training + "{{ strftime_now('%Y') }}", {})) is None
