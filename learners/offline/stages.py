"""What differs between the offline stages (`tandem sft`, `tandem rm`, `tandem dpo`): one small object each,
used by the one loop of `learners.offline.loop`.

    stage = make_stage("dpo", config, model_dir, tokenizer, device, dtype)    # SftStage | RewardStage | DpoStage
    rows_train, rows_eval = stage.rows()                     # from stage cfg's source (or `arithmetic`)
    example = stage.tokenize(tokenizer, row, max_len)        # ChatExample | PairExample
    units = stage.loss_units(examples)                       # what the loss averages over: tokens | pairs
    loss_sum, sums = stage.micro_batch(forward, examples)    # sum over units of the loss (grad), stat sums
    stage.metrics(global_sums)                               # {"dpo/loss": ..., "dpo/accuracy": ...}

The loop divides `loss_sum` by the units of the GLOBAL batch (all ranks, all micro-batches), so the micro-batches
and ranks add up to one mean: SFT's token-mean NLL over the batch's assistant tokens, or the mean loss over its
pairs. `sums` are float64 sums of per-unit statistics (summed over micro-batches and ranks by the loop before
`metrics` divides them); every stage's sums carry `rows` (chats or pairs) and `seq_tokens` (real tokens in the
forward passes, pairs counting both replies).

Sequences are right-padded (`learners.offline.data.pad_right`) under an attention mask, so a real token's
position and inputs are those of the unpadded sequence. A pair's two replies share one forward: rows [0, b)
are prompt + chosen, rows [b, 2b) prompt + rejected. Log-probs of a reply are read at the positions that predict
its tokens (`learners.logprobs.logprobs_from_logits` on the logits shifted by one).

RM: `AutoModelForSequenceClassification` with one label built from model.path (the policy's architecture and
weights, a fresh scalar head `score` drawn from torch's RNG: the loop seeds it with run.seed, so every rank and
every run draws the same head), its config's pad_token_id set from the tokenizer: the model pools at the last
token that is not the pad id, which is what lets it score a right-padded batch. The reward is that logit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from common.chat_format import ChatFormat, chat_format
from common.config import DpoConfig, RmConfig, SftConfig, TandemConfig
from learners.logprobs import logprobs_from_logits
from learners.losses import bradley_terry_loss, dpo_loss, sft_token_nll
from learners.models import load_policy, load_reference
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

Forward = Callable[..., Any]  # the DeepSpeed engine (train) or the module itself: model(input_ids=..., ...)
STAGES = ("sft", "rm", "dpo")


def stage_chat_format(config: TandemConfig, tokenizer: Any) -> ChatFormat:
    """How the stage renders its rows (model.chat_template and its kwargs, common.chat_format), checked with its
    tokenizer: ValueError, one line, for a missing template file or one that fails to render."""
    chat = chat_format(config.model)
    chat.check(tokenizer)
    return chat


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, else its eos id (SmolLM2: the same id); ValueError when it has neither."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the model's tokenizer has no pad and no eos token: set pad_token_id in its config")
    return int(pad)


def _split_file_rows(rows: list[Any], cfg: SftConfig | RmConfig, eval_rows: list[Any] | None) -> tuple[list, list]:
    """(train, eval): eval_source's rows when given, else the last `held_out` share of the source (at least one
    row when held_out > 0 and the source has two); eval capped at num_eval_examples."""
    if eval_rows is None:
        keep = math.floor(len(rows) * cfg.held_out)
        keep = max(keep, 1) if cfg.held_out > 0 and len(rows) > 1 else keep
        rows, eval_rows = rows[: len(rows) - keep], rows[len(rows) - keep :]
    return rows, eval_rows[: cfg.num_eval_examples]


@dataclass
class _Sequences:
    """Right-padded sequences of one micro-batch on the device: ids, attention [n, L], reply/loss mask [n, L]."""

    input_ids: Tensor
    attention_mask: Tensor
    target_mask: Tensor  # True on the tokens the loss reads (assistant tokens, a pair's reply tokens)

    @classmethod
    def build(cls, ids: list[list[int]], masks: list[list[bool]], pad_id: int, device: torch.device) -> _Sequences:
        input_ids, attention = pad_right(ids, pad_id)  # [n, L], [n, L]
        target, _ = pad_right([[int(m) for m in mask] for mask in masks], 0)  # [n, L]
        return cls(input_ids.to(device), attention.to(device), target.bool().to(device) & attention.to(device))

    def token_logprobs(self, forward: Forward) -> tuple[Tensor, Tensor]:
        """(log p of tokens t0.. [n, L - t0], the mask of those the loss reads [n, L - t0]), t0 >= 1 the first
        position any row's loss reads. Logits are computed from position t0 - 1 on only (`logits_to_keep`):
        the vocabulary projection of the prompt positions, most of a chat, is never needed."""
        targets = self.target_mask.any(dim=0).nonzero()
        first = max(1, int(targets[0])) if len(targets) else self.input_ids.shape[1] - 1  # t0
        keep = self.input_ids.shape[1] - first + 1  # positions t0 - 1 .. L - 1
        out = forward(
            input_ids=self.input_ids, attention_mask=self.attention_mask.long(), logits_to_keep=keep, use_cache=False
        )
        logprobs = logprobs_from_logits(out.logits[:, :-1], self.input_ids[:, first:])  # position t predicts t + 1
        return logprobs, self.target_mask[:, first:]

    def real_tokens(self) -> float:
        return float(self.attention_mask.sum())


def _pair_sequences(examples: Sequence[PairExample], pad_id: int, device: torch.device) -> _Sequences:
    """Rows [0, b): prompt + chosen; rows [b, 2b): prompt + rejected; the mask on the reply tokens."""
    ids, masks = [], []
    for reply in ("chosen_ids", "rejected_ids"):
        for example in examples:
            tokens = getattr(example, reply)
            ids.append([*example.prompt_ids, *tokens])
            masks.append([False] * len(example.prompt_ids) + [True] * len(tokens))
    return _Sequences.build(ids, masks, pad_id, device)


def _sums(**values: Tensor | float) -> dict[str, float]:
    return {
        key: float(value.detach().double().sum()) if isinstance(value, Tensor) else value
        for key, value in values.items()
    }


class SftStage:
    """Supervised fine-tuning: the token-mean NLL of the assistant tokens (`learners.offline.data.tokenize_chat`)."""

    name = "sft"

    def __init__(
        self, config: TandemConfig, model_dir: Path, tokenizer: Any, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.cfg, self.device, self.seed = config.sft, device, config.run.seed
        self.pad_id = pad_token_id(tokenizer)
        self.chat = stage_chat_format(config, tokenizer)
        self.model: nn.Module = load_policy(
            model_dir, dtype, config.learner.gradient_checkpointing, config.learner.attn_implementation
        )

    def rows(self) -> tuple[list[list[dict]], list[list[dict]]]:
        cfg = self.cfg
        if cfg.source == "arithmetic":
            from common.rlhf_data import arithmetic_sft_rows

            def build(n: int, split: str) -> list[list[dict]]:
                made = arithmetic_sft_rows(n, seed=self.seed, difficulty=cfg.difficulty, split=split)
                return [row["messages"] for row in made]

            return build(cfg.num_examples, "train"), build(cfg.num_eval_examples, "held_out")
        eval_rows = chat_rows(cfg.eval_source, cfg) if cfg.eval_source else None
        return _split_file_rows(chat_rows(cfg.source, cfg), cfg, eval_rows)

    def tokenize(self, tokenizer: Any, row: list[dict], max_len: int) -> ChatExample:
        return tokenize_chat(tokenizer, row, max_len, self.chat)

    def loss_units(self, examples: Sequence[ChatExample]) -> int:
        """Assistant tokens that a position predicts (every one but a row's first token)."""
        return sum(sum(bool(m) for m in example.loss_mask[1:]) for example in examples)

    def micro_batch(self, forward: Forward, examples: Sequence[ChatExample]) -> tuple[Tensor, dict[str, float]]:
        seqs = _Sequences.build(
            [e.input_ids for e in examples], [e.loss_mask for e in examples], self.pad_id, self.device
        )
        logprobs, mask = seqs.token_logprobs(forward)  # [b, L-1]
        nll = sft_token_nll(logprobs, mask)  # [b]
        loss_sum = nll.sum()
        return loss_sum, _sums(nll=nll, tokens=mask, rows=float(len(examples)), seq_tokens=seqs.real_tokens())

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {"sft/loss": sums["nll"] / max(sums["tokens"], 1.0), "sft/tokens": sums["tokens"]}


class _PairStage:
    """What RM and DPO share: preference rows, pair tokenization, one unit per pair, per-pair statistics."""

    name = ""
    cfg: RmConfig
    seed: int
    chat: ChatFormat

    def rows(self) -> tuple[list[PreferenceRow], list[PreferenceRow]]:
        cfg = self.cfg
        if cfg.source == "arithmetic":
            from common.rlhf_data import arithmetic_preference_rows

            def build(n: int, split: str) -> list[PreferenceRow]:
                made = arithmetic_preference_rows(n, seed=self.seed, difficulty=cfg.difficulty, split=split)
                return [PreferenceRow(row["prompt"], row["chosen"], row["rejected"]) for row in made]

            return build(cfg.num_examples, "train"), build(cfg.num_eval_examples, "held_out")
        eval_rows = preference_rows(cfg.eval_source, cfg) if cfg.eval_source else None
        return _split_file_rows(preference_rows(cfg.source, cfg), cfg, eval_rows)

    def tokenize(self, tokenizer: Any, row: PreferenceRow, max_len: int) -> PairExample:
        return tokenize_pair(tokenizer, row.prompt, row.chosen, row.rejected, max_len, self.chat)

    def loss_units(self, examples: Sequence[PairExample]) -> int:
        return len(examples)

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        pairs = max(sums["rows"], 1.0)
        keys = ("loss", "accuracy", "margin", "reward_chosen", "reward_rejected")
        return {f"{self.name}/{key}": sums[key] / pairs for key in keys}


class RewardStage(_PairStage):
    """Reward-model training: Bradley-Terry on the scalar head's scores of chosen and rejected (module docstring)."""

    name = "rm"

    def __init__(
        self, config: TandemConfig, model_dir: Path, tokenizer: Any, device: torch.device, dtype: torch.dtype
    ) -> None:
        from transformers import AutoModelForSequenceClassification

        self.cfg, self.device, self.seed = config.rm, device, config.run.seed
        self.pad_id = pad_token_id(tokenizer)
        self.chat = stage_chat_format(config, tokenizer)
        model = AutoModelForSequenceClassification.from_pretrained(
            str(model_dir),
            num_labels=1,
            pad_token_id=self.pad_id,
            dtype=dtype,
            local_files_only=True,
        )
        model.config.use_cache = False
        model.config.architectures = [type(model).__name__]  # what an export's config.json says it is
        if config.learner.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        self.model: nn.Module = model

    def scores(self, forward: Forward, seqs: _Sequences) -> Tensor:
        """The reward of each sequence [n]: the head's logit at its last real token (the model's own pooling)."""
        out = forward(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask.long(), use_cache=False)
        return out.logits[:, 0].float()

    def micro_batch(self, forward: Forward, examples: Sequence[PairExample]) -> tuple[Tensor, dict[str, float]]:
        seqs = _pair_sequences(examples, self.pad_id, self.device)
        scores = self.scores(forward, seqs)  # [2b]
        chosen, rejected = scores[: len(examples)], scores[len(examples) :]  # [b], [b]
        loss, stats = bradley_terry_loss(chosen, rejected, self.cfg.margin)
        sums = _sums(
            loss=loss,
            reward_chosen=chosen,
            reward_rejected=rejected,
            rows=float(len(examples)),
            seq_tokens=seqs.real_tokens(),
            **stats,
        )
        return loss.sum(), sums


class DpoStage(_PairStage):
    """DPO (sigmoid, cDPO, IPO) of the policy against a frozen reference (dpo.reference, else model.path)."""

    name = "dpo"

    def __init__(
        self, config: TandemConfig, model_dir: Path, tokenizer: Any, device: torch.device, dtype: torch.dtype
    ) -> None:
        from common.model_prep import resolve_model_path

        self.cfg: DpoConfig = config.dpo
        self.device, self.seed = device, config.run.seed
        self.pad_id = pad_token_id(tokenizer)
        self.chat = stage_chat_format(config, tokenizer)
        self.model: nn.Module = load_policy(
            model_dir, dtype, config.learner.gradient_checkpointing, config.learner.attn_implementation
        )
        self.reference = load_reference(
            resolve_model_path(self.cfg.reference or config.model.path), dtype, config.learner.attn_implementation
        ).to(device)

    def _reply_logprobs(self, forward: Forward, seqs: _Sequences) -> Tensor:
        """Each reply's log-prob [n]: the sum over its tokens (sigmoid), their mean (ipo)."""
        logprobs, mask = seqs.token_logprobs(forward)  # [n, L-1]
        total = torch.where(mask, logprobs, 0).sum(dim=1)  # [n]
        return total if self.cfg.loss == "sigmoid" else total / mask.sum(dim=1).clamp(min=1)

    def micro_batch(self, forward: Forward, examples: Sequence[PairExample]) -> tuple[Tensor, dict[str, float]]:
        b = len(examples)
        seqs = _pair_sequences(examples, self.pad_id, self.device)
        policy = self._reply_logprobs(forward, seqs)  # [2b]
        with torch.no_grad():
            reference = self._reply_logprobs(self.reference, seqs)  # [2b]
        cfg = self.cfg
        loss, stats = dpo_loss(
            policy[:b], policy[b:], reference[:b], reference[b:], cfg.beta, cfg.loss, cfg.label_smoothing
        )
        return loss.sum(), _sums(loss=loss, rows=float(b), seq_tokens=seqs.real_tokens(), **stats)


Stage = SftStage | RewardStage | DpoStage


def make_stage(
    name: str, config: TandemConfig, model_dir: Path, tokenizer: Any, device: torch.device, dtype: torch.dtype
) -> Stage:
    """The stage `name` (sft, rm, dpo) with its model(s) built from `model_dir` (model.path resolved) on the CPU in
    `dtype` (model.dtype resolved for this machine: `learners.models.training_dtype`); the engine moves the trained
    one to `device`, DPO's reference goes there at once."""
    stages = {"sft": SftStage, "rm": RewardStage, "dpo": DpoStage}
    if name not in stages:
        raise ValueError(f"unknown offline stage {name!r} (one of {', '.join(STAGES)})")
    return stages[name](config, model_dir, tokenizer, device, dtype)
