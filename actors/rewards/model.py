"""A learned reward model: a Hugging Face sequence-classification model with one label scores whole chats.

    scorer = RewardModelScorer(Path("runs/rm/model"), dtype="float32", batch_size=32, max_len=1024, normalize=False)
    scores = scorer.score_group(prompt_messages, completions)   # one float per completion, in order
    scores = scorer.score_chats([chat, chat, ...])              # each chat ends with the assistant turn scored

What is scored: the chat (the prompt's messages, then the completion as an assistant turn) through the RM's own
tokenizer and the run's chat format (`chat`: model.chat_template and its kwargs, common.chat_format; with
model.chat_template empty, the RM tokenizer's own template), as every stage renders: the prompt's tokens exactly as `common.tasks.render_prompt` renders them for generation,
then the tokens of the text the template appends for the reply (its content and end of turn). This is the
sequence `tandem rm` trains on (learners.offline.data.tokenize_pair: a preference pair's prompt + reply), so a
score here is the score the trainer saw.

Score = the model's single logit at the last real token, from the model's own pooling: rows are right-padded
with `pad_token_id` under an attention mask, and transformers' sequence-classification heads pool at the
rightmost token that is not `pad_token_id`. That is the last real token unless a row's own last token is the pad
id: such a chat template is refused at load (ValueError), and a row that ends so anyway raises ValueError rather
than being scored at the wrong position. Right padding under a causal mask leaves every real position's inputs
unchanged, so a batched score equals the one-by-one score up to float rounding (kernels sum in another order).

Normalisation (`normalize`): every score given updates a running mean and variance (Welford, in the order the
scores are given: rows of a call in order); the score returned is (s - mean) / std with both after s, the
population std; 0 while std is 0 (the first score). Raw scores drift with the model; normalised ones keep the
reward's scale.

Chats longer than `max_len` tokens keep their last `max_len` tokens (the end is what the score reads), counted in
`truncated`. Threads: torch uses one per core this process may run on.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from common.chat_format import TOKENIZER_OWN, ChatFormat
from common.chat_tokens import reply_ids
from common.devices import reward_model_device
from common.dtypes import DTYPE_CHOICES, choose_dtype
from common.padding import pad_right
from common.tasks import PromptRecord, render_prompt

log = logging.getLogger("tandem.actors.reward_model")

DTYPES = DTYPE_CHOICES  # reward.dtype: "auto" (common.dtypes), "bfloat16" or "float32"
_PROBE_CHAT = [{"role": "user", "content": "1 + 1 = ?"}, {"role": "assistant", "content": "2"}]


class RunningNorm:
    """Welford's running mean and (population) variance; `normalize(s)` adds s, then gives (s - mean) / std."""

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the running mean

    def add(self, value: float) -> None:
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (value - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def normalize(self, value: float) -> float:
        self.add(value)
        std = self.std
        return (value - self.mean) / std if std > 0 else 0.0


class RewardModelScorer:
    """Scores chats with a sequence-classification reward model (see the module docstring). One thread at a time.

    Raises at construction: FileNotFoundError for a directory without config.json, ValueError for a model
    with more than one label, a tokenizer without a chat template, or a template whose rendered chats end with
    the pad token id (the model's pooling would skip it).
    """

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        batch_size: int,
        max_len: int,
        normalize: bool,
        device: str = "auto",
        chat: ChatFormat = TOKENIZER_OWN,
    ) -> None:
        """`chat`: how chats are rendered (common.chat_format; the module docstring). `device`: "auto" = CUDA when this process was given GPUs (CUDA_VISIBLE_DEVICES names one: the reward
        service under `tandem run`, or with ray.reward_gpus > 0) and torch sees one, else the CPU
        (`common.devices.reward_model_device`); "cpu" always (a generator scoring in-process beside vLLM, which
        holds its GPU's memory)."""
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        model_dir = Path(model_dir)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"env.reward_model: '{model_dir}' is not a Hugging Face model directory (no config.json in it): "
                "name what `tandem rm` exported (<run_dir>/model) or another sequence-classification model"
            )
        if dtype not in DTYPES:
            raise ValueError(f"reward.dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        if batch_size < 1 or max_len < 2:
            raise ValueError(f"batch_size ({batch_size}) must be >= 1 and max_len ({max_len}) >= 2")
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        self._torch = torch
        self.model_dir = model_dir
        self.batch_size = batch_size
        self.max_len = max_len
        self.norm = RunningNorm() if normalize else None
        self.chat = chat
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self.device = torch.device(reward_model_device(device, visible, torch.cuda.is_available))
        cuda_bf16 = torch.cuda.is_bf16_supported(including_emulation=False) if self.device.type == "cuda" else None
        dtype = choose_dtype(dtype, cuda_bf16, key="reward.dtype", logger=log).dtype  # "auto": this machine's
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"env.reward_model: '{model_dir}' has {self.model.config.num_labels} labels; a reward model has one "
                "(AutoModelForSequenceClassification with num_labels = 1, what `tandem rm` exports)"
            )
        self.scored = 0  # chats scored
        self.truncated = 0  # chats cut to their last max_len tokens
        self.seconds = 0.0  # spent in forward passes
        self.pad_id = self._pad_token_id()
        self._check_template()

    def _pad_token_id(self) -> int:
        """The id rows are padded with, set on the model's config (its pooling finds the last real token by it):
        the config's own, else the tokenizer's pad, else its eos."""
        config = self.model.config
        pad = config.pad_token_id
        if pad is None:
            pad = (
                self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
            )
        if pad is None:
            raise ValueError(f"env.reward_model: '{self.model_dir}' names no pad, nor eos, token: set pad_token_id")
        config.pad_token_id = int(pad)
        return int(pad)

    def _check_template(self) -> None:
        if self.chat.template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"env.reward_model: the tokenizer of '{self.model_dir}' has no chat template: the RM scores chats"
            )
        self.chat.check(self.tokenizer)
        probe = self.tokenize(_PROBE_CHAT)
        self.truncated = 0  # the probe is not a scored chat
        if probe[-1] == self.pad_id:
            raise ValueError(
                f"env.reward_model: the chat template of '{self.model_dir}' ends a turn with the pad token "
                f"(id {self.pad_id}), which the model's pooling skips: give the model a pad_token_id of its own"
            )

    def tokenize(self, chat: list[dict[str, str]]) -> list[int]:
        """The ids of a chat whose last message is the reply scored, its last max_len tokens: the prompt (the
        messages before the reply) as `common.tasks.render_prompt` renders it for generation, then the text the
        template appends to it when the whole chat is rendered (the reply and its end of turn), tokenized on its
        own (`common.chat_tokens.reply_ids`, which `tandem rm` tokenizes a pair's replies with). Raises
        ValueError for a chat that does not end with an assistant turn, or a template that rewrites the prompt's
        text when the reply is added (not prefix-stable)."""
        if len(chat) < 2 or chat[-1].get("role") != "assistant":
            raise ValueError("a scored chat is a prompt and then the reply: its last message must be the assistant's")
        prompt = PromptRecord(0, list(chat[:-1]))
        what = f"the reply (model '{self.model_dir}')"
        reply = reply_ids(self.tokenizer, prompt.messages, list(chat[-1:]), what, self.chat)
        return self._cut(render_prompt(self.tokenizer, prompt, self.chat) + reply)

    def _cut(self, ids: list[int]) -> list[int]:
        if len(ids) > self.max_len:
            self.truncated += 1
            ids = ids[-self.max_len :]
        return ids

    def score_group(self, prompt: list[dict[str, str]], completions: list[str]) -> list[float]:
        """One score per completion, each appended to `prompt` as an assistant turn."""
        return self.score_chats([[*prompt, {"role": "assistant", "content": text}] for text in completions])

    def score_chats(self, chats: list[list[dict[str, str]]]) -> list[float]:
        """One score per chat, in order: raw, or normalised when the scorer normalises (module docstring)."""
        raw = self.raw_scores([self.tokenize(chat) for chat in chats])
        return raw if self.norm is None else [self.norm.normalize(s) for s in raw]

    def raw_scores(self, rows: list[list[int]]) -> list[float]:
        """The model's logit at each row's last token, in batches of batch_size (rows sorted by length inside
        the call, so that a batch pads little; scores come back in the rows' order)."""
        started = time.monotonic()
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        scores = [0.0] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            for i, score in zip(chunk, self._forward([rows[i] for i in chunk])):
                scores[i] = score
        self.scored += len(rows)
        self.seconds += time.monotonic() - started
        return scores

    def _forward(self, rows: list[list[int]]) -> list[float]:
        torch = self._torch
        if any(not row for row in rows):
            raise ValueError("a chat rendered to no tokens: nothing to score")
        if any(row[-1] == self.pad_id for row in rows):
            raise ValueError(f"a chat ends with the pad token (id {self.pad_id}): the model's pooling would skip it")
        input_ids, real = pad_right(rows, self.pad_id)  # [B, L] right-padded, [B, L] True on real tokens
        with torch.inference_mode():
            inputs = {"input_ids": input_ids.to(self.device), "attention_mask": real.long().to(self.device)}
            logits = self.model(**inputs).logits  # [B, 1]
        return [float(v) for v in logits[:, 0].float()]

    def describe(self) -> dict[str, Any]:
        """What was loaded, for the log line of the role that loads it."""
        parameters = sum(p.numel() for p in self.model.parameters())
        return {
            "model": str(self.model_dir),
            "parameters": parameters,
            "dtype": str(self.model.dtype),
            "device": str(self.device),
        }
