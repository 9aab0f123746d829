"""One RL update on one batch: `Trainer.train_step(groups, staleness) -> metrics`, usable without any socket.

    trainer = Trainer.from_config(config, init_distributed())
    stats = trainer.train_step(batch.groups, batch.staleness)     # ppo_epochs x mini_batches optimizer steps
    for name, tensor in trainer.full_weights(): ...               # HF names; collective under ZeRO-3

The update, in order (B samples on this rank, T completion columns, V vocabulary):
  1. pad the groups into [B, T] tensors (`learners.batching`); split the rows into `learner.mini_batches`
     mini-batches (one optimizer step each; whole groups when they divide evenly), each into `micro_steps`
     micro-batches (`learners.engine.TrainEngine.begin_micro_batch` marks the last one of a step). With
     learner.max_tokens_per_micro_batch > 0 the micro-batches are by token count instead (prompt + completion,
     padding not counted; `learners.batching.token_budget_micro_batches`), so their number varies: every rank
     takes the most any rank has (one all-reduce per batch; a rank with fewer splits its largest), because the
     accumulation boundary is collective. learner.packing puts several samples in one row (`packed_inputs`);
     the completion-aligned tensors keep their [b, T'] layout, and `ModelInputs.predicting` reads each model
     output (logits, hidden states, values) at the positions that predict the completion tokens, padded or
     packed alike;
  2. no-grad pass, only when needed: reference log-probs (algo.kl_coef > 0), critic values (estimator gae),
     the current policy's log-probs (KL in the reward, the proximal log-probs when there is more than one
     optimizer step per batch, and distillation), the teacher's log-probs (algo.teacher_model: its per-token
     reverse KL joins the advantages, `learners.distillation`);
  3. advantages for the estimator (`learners.estimators`); batch-level normalisations (reinforce_pp, gae)
     use the statistics of the GLOBAL batch (summed over ranks), so every rank count gives the same update.
     algo.overlong (`learners.overlong`, wired in `learners.objective`): "penalty" adds DAPO's soft overlong
     penalty to the rewards first (so every estimator sees it); "mask" clears the truncated samples' loss mask
     after the advantages (their rewards stay in the group baselines), so steps 4-5 and their denominators leave
     them out;
  4. `algo.ppo_epochs` times over the mini-batches, per micro-batch: forward with grad -> log-probs and
     entropies (logits / sampling temperature; the output layer fused with the softmax in chunks, so the
     [b, T', V] logits never exist: `learners.completion_logprobs`) -> the policy objective
     (`learners.objective.policy_objective`: policy_loss with the configured correction against
     `behaviour_logprobs`, + KL term, - entropy bonus) -> backward -> step (the optimizer steps after a
     mini-batch's last micro-batch). The proximal policy is the one before the batch's first step: step 2's
     log-probs with several steps per batch, else logprobs.detach() (ratio 1; `learners.objective` says why).
     The advantages are computed once, on the whole batch.
  5. the critic (gae) trains on the same schedule (epochs, mini-batches, micro-batches) with the clipped value
     loss, its own engine and its own learning rate; its old values are taken once, in step 2.
The policy version advances, and weights publish, once per `train_step` (`learners.learner`), however many
optimizer steps it took; learner.warmup_steps and the lr schedule count optimizer steps.

Equivalence invariant, per mini-batch: every micro-batch's loss is scaled by its share of its mini-batch's
GLOBAL loss units (action tokens for token_mean, non-empty rows for seq_mean, summed over ranks) times the world
size, because DeepSpeed averages gradients over ranks and does not rescale by the micro-steps (see
`learners.engine`). Each optimizer step therefore equals one step on the whole global mini-batch, whatever
`micro_batch_size` and `world_size` are (with mini_batches = 1: one step on the whole global batch).

Metrics: those `learners.objective` records (`loss/…`, `policy/…` but `policy/lr`, `critic/clip_frac`,
`rollout/truncated_share`, `reward/overlong_penalty`) are described there.
`perf/padding_fraction` is padded positions / all positions of the update's forwards, `perf/tokens_per_micro_batch`
the mean prompt + completion tokens of a micro-batch, `perf/peak_rss_mb` the process's peak resident memory so far
(getrusage ru_maxrss; the largest rank's; it never falls, so it is the run's peak, not the step's).

Exactness of packing and token budgets: they change which samples share a forward and how wide its rows are, never
what a sample sees (its own positions from 0, only its own earlier tokens) or how a micro-batch's loss is weighted
(its share of the mini-batch's loss units), so the update equals the padded fixed-size one up to the order of
float32 sums (tests/learners/test_packing.py). With flash-attention (model config `_attn_implementation`
flash_*) the packed rows are laid end to end in one row, the only layout in which transformers turns the restarting
position_ids into varlen attention (cu_seqlens); that path is not tested here (no GPU).

Non-finite guard: a step whose loss or gradient is not finite on any rank is skipped on every rank (the weights
and the optimizer state stay bit-identical; see `learners.engine`), logged, and counted in
`learner/steps_skipped_nonfinite` (`learner/critic_steps_skipped_nonfinite` for the critic). Whatever the buffer
lets through, a NaN never reaches the weights.

LoRA (`learner.lora.rank` > 0, `learners.models`, docs/lora.md): the policy and the critic's backbone carry peft
adapters and only those train (and the value head); the reference is the policy with its adapters disabled.
`full_weights` publishes the merged full weights under the HF names (sync = "merged") or the A/B matrices alone
(sync = "adapter"); `save_state` adds the peft adapter (`adapter/`) beside the merged HF export (`hf/`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from common.config import AlgoConfig, LearnerConfig, ModelConfig, TandemConfig, batch_split_problems
from common.model_prep import resolve_model_path
from common.types import RolloutGroup
from learners import engine as eng
from learners.batching import (
    ModelInputs,
    PaddedBatch,
    Rows,
    mini_batch_rows,
    pad_groups,
    split_to_count,
    token_budget_micro_batches,
)
from learners.checkpoint import check_resume_dtype, export_adapter, export_hf_model
from learners.checkpoint_names import checkpoint_layout, checkpoint_weights
from learners.completion_logprobs import completion_logprobs, fused_head
from learners.distillation import distill_metrics, load_teacher
from learners.models import (
    ADAPTER,
    AdaptersOff,
    ValueModel,
    adapter_layout,
    adapter_weights,
    add_adapters,
    load_policy,
    load_reference,
    merged_layout,
    merged_weights,
    torch_dtype,
    training_dtype,
)
from learners.objective import (
    PreUpdate,
    advantages_and_returns,
    overlong_masked,
    overlong_metrics,
    overlong_shaping,
    policy_objective,
    value_objective,
)
from learners.rollout_stats import rollout_summary
from learners.update_stats import GlobalAverages, InputShape, loss_units

log = logging.getLogger("tandem.learner.trainer")


class Trainer:
    """The policy (a DeepSpeed engine), the optional frozen reference and the optional critic; one update per
    `train_step`. Every method is collective across data-parallel ranks: call them on every rank, in order."""

    def __init__(
        self,
        model_dir: Path,
        model: ModelConfig,
        algo: AlgoConfig,
        learner: LearnerConfig,
        temperature: float,
        overlong: tuple[int, int],
        dist: eng.DistInfo,
    ) -> None:
        problems = batch_split_problems(learner, algo, dist.world_size)  # the config's rule, on the real ranks
        if problems:
            raise ValueError("; ".join(problems))
        self.model_dir, self.algo, self.dist, self.temperature = Path(model_dir), algo, dist, temperature
        self.overlong_budget, self.overlong_window = overlong  # L_max and L_cache of algo.overlong = "penalty"
        self.requested_dtype, self.dtype = model.dtype, training_dtype(model.dtype, eng.device())
        dtype = torch_dtype(self.dtype)
        rank_samples = learner.groups_per_step // dist.world_size * algo.group_size
        self.mini_batches = learner.mini_batches
        self.steps_per_batch = algo.ppo_epochs * learner.mini_batches  # optimizer steps per train_step
        self.micro_steps = math.ceil(rank_samples // learner.mini_batches / learner.micro_batch_size)  # per step
        self.token_budget, self.packing = learner.max_tokens_per_micro_batch, learner.packing  # 0: micro_steps
        settings = eng.EngineSettings(
            lr=learner.lr,
            zero_stage=learner.zero_stage,
            bf16=self.dtype == "bfloat16",
            micro_batch_size=learner.micro_batch_size,
            micro_steps=self.micro_steps,
            weight_decay=learner.weight_decay,
            grad_clip=learner.grad_clip,
            warmup_steps=learner.warmup_steps,
            lr_schedule=learner.lr_schedule,
            min_lr_ratio=learner.min_lr_ratio,
            decay_steps=learner.total_steps * algo.ppo_epochs * learner.mini_batches,
        )
        self.device = eng.device()
        self.lora = learner.lora if learner.lora.rank > 0 else None  # adapters on the policy and the critic
        policy = load_policy(self.model_dir, dtype, learner.gradient_checkpointing, learner.attn_implementation)
        self.policy = eng.TrainEngine(add_adapters(policy, self.lora) if self.lora else policy, settings)
        self.pad_id = int(self.policy.module.config.pad_token_id or 0)
        attention = str(getattr(self.policy.module.config, "_attn_implementation", ""))
        self.one_row = learner.packing and attention.startswith("flash")  # varlen: packed samples in one row
        self.reference = None
        if algo.kl_coef > 0:  # with adapters: the policy with them disabled is the initial model (learners.models)
            self.reference = (
                AdaptersOff(self.policy.module, self.policy, self.policy.zero3)
                if self.lora
                else load_reference(self.model_dir, dtype, learner.attn_implementation).to(self.device)
            )
        self.teacher = None  # on-policy distillation: the same dtype and attention as the reference
        if algo.teacher_model:
            teacher_dir = resolve_model_path(algo.teacher_model)
            self.teacher = load_teacher(teacher_dir, self.model_dir, dtype, learner.attn_implementation)
            self.teacher.to(self.device)
        self.critic = None
        if algo.estimator == "gae":
            critic_settings = replace(settings, lr=learner.critic_lr)
            critic_dir = resolve_model_path(learner.critic_path) if learner.critic_path else self.model_dir
            critic = ValueModel.from_pretrained(
                critic_dir, dtype, learner.gradient_checkpointing, self.lora, learner.attn_implementation
            )
            self.critic = eng.TrainEngine(critic, critic_settings)

    @classmethod
    def from_config(cls, config: TandemConfig, dist: eng.DistInfo) -> Trainer:
        """The model dir comes from `resolve_model_path(model.path)`; logits are divided by the generator's
        sampling temperature, so that log-probs match the behaviour log-probs the generator recorded. The overlong
        penalty's budget and window are `TandemConfig.overlong_budget` and `.overlong_window`."""
        return cls(
            resolve_model_path(config.model.path),
            config.model,
            config.algo,
            config.learner,
            config.generator.temperature,
            (config.overlong_budget, config.overlong_window),
            dist,
        )

    # ------------------------------------------------------------------------------------------------ the step
    def train_step(self, groups: Sequence[RolloutGroup], staleness: Sequence[np.ndarray]) -> dict[str, float]:
        """One update (`steps_per_batch` optimizer steps) on the global batch whose share on this rank is `groups`.

        Returns the metrics of the global batch (identical on every rank): reward/staleness statistics,
        losses, policy diagnostics and timings. Raises ValueError for an empty or malformed share.
        """
        batch = pad_groups(groups, staleness, self.pad_id, first_group_id=self.dist.rank * len(groups))
        schedule = self._schedule(batch)  # [mini-batch][micro-batch] -> rows
        summary = rollout_summary(
            groups,
            staleness,
            self.algo.max_staleness,
            self._sum_ranks,
            self._max_ranks,
            self.dist.rank,
            self.dist.world_size,
        )
        truncated, penalty = overlong_shaping(self.algo, groups, batch, self.overlong_budget, self.overlong_window)
        start = time.perf_counter()
        with torch.no_grad():
            pre = self._pre_update(batch, [rows for mini in schedule for rows in mini])
            shaped = replace(batch, rewards=batch.rewards + penalty)  # [B]: the overlong penalty (0 unless on)
            advantages, returns = advantages_and_returns(self.algo, shaped, pre, eng.all_reduce)
        batch = overlong_masked(self.algo, batch, truncated)  # after the advantages: the group baselines count them
        pre_s = time.perf_counter() - start
        stats, forward_s, backward_s = self._update(batch, schedule, pre, advantages, returns)
        stats.update(overlong_metrics(truncated, penalty, self._sum_ranks))
        if pre.teacher_logprobs is not None:
            stats.update(distill_metrics(pre.logprobs, pre.teacher_logprobs, batch.loss_mask, self._sum_ranks))
        stats.update(self._skipped_steps())
        stats["perf/forward_s"] = pre_s + forward_s
        stats["perf/backward_s"] = backward_s
        stats["policy/lr"] = self.policy.learning_rate()
        return {**summary, **stats}

    def _skipped_steps(self) -> dict[str, float]:
        """Counts of updates skipped as not finite (`learners.engine`: the weights stay as they were, on every
        rank), logged when the step just taken was one."""
        engines = {"learner/steps_skipped_nonfinite": self.policy}
        if self.critic is not None:
            engines["learner/critic_steps_skipped_nonfinite"] = self.critic
        for name, engine in engines.items():
            if engine.last_step_skipped:
                log.warning(
                    "%s: a non-finite loss or gradient; this update was skipped (%d so far)", name, engine.skipped_steps
                )
        return {name: float(engine.skipped_steps) for name, engine in engines.items()}

    def _model_logprobs(self, model: object, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [b, T'], entropies [b, T']) of the completion tokens under softmax(logits / temperature)
        (`learners.completion_logprobs`), fused where `_fused_head` allows; the entropy carries a gradient only
        when the entropy bonus is on (algo.entropy_coef > 0)."""
        head = self._fused_head(model)
        return completion_logprobs(model, inputs, self.temperature, head, entropy_grad=self.algo.entropy_coef > 0)

    def _fused_head(self, model: object) -> torch.Tensor | torch.nn.Module | None:
        """The output layer's weight [V, H] when `_model_logprobs` may bypass the layer (under ZeRO-3 the layer
        itself), else None: for logits that are more than `hidden @ weight.T`
        (`learners.completion_logprobs.fused_head`)."""
        engine = model if isinstance(model, eng.TrainEngine) else None
        return fused_head(engine.module if engine is not None else model, engine is not None and engine.zero3)

    def _critic_values(self, inputs: ModelInputs) -> torch.Tensor:
        """V(s_t) [b, T'] for each completion token t, read at the position that predicts t."""
        return inputs.predicting(self.critic(**inputs.forward_kwargs(), values_to_keep=inputs.keep))

    def _pre_update(self, batch: PaddedBatch, rows: list[Rows]) -> PreUpdate:
        need_ref, need_teacher = self.reference is not None, self.teacher is not None
        # the proximal log-probs, once before the first of several steps (with one step they are logprobs.detach()),
        # and for the teacher's term (learners.distillation: the KL of the weights before the update)
        need_logprobs = (need_ref and self.algo.kl_in_reward) or self.steps_per_batch > 1 or need_teacher
        pre = PreUpdate()
        shape = (batch.size, batch.width)
        if need_ref:
            pre.ref_logprobs = torch.zeros(shape)
        if need_teacher:
            pre.teacher_logprobs = torch.zeros(shape)
        if need_logprobs:
            pre.logprobs = torch.zeros(shape)
        if self.critic is not None:
            pre.old_values = torch.zeros(shape)
            self.critic.train(False)
        for part in rows:
            inputs = batch.model_inputs(part, self.device, self.packing, self.one_row)
            width = inputs.width
            if need_ref:
                pre.ref_logprobs[part, :width] = self._model_logprobs(self.reference, inputs)[0].float().cpu()
            if need_logprobs:
                pre.logprobs[part, :width] = self._model_logprobs(self.policy, inputs)[0].float().cpu()
            if need_teacher:
                pre.teacher_logprobs[part, :width] = self._model_logprobs(self.teacher, inputs)[0].float().cpu()
            if self.critic is not None:
                pre.old_values[part, :width] = self._critic_values(inputs).float().cpu()
        if self.critic is not None:
            self.critic.train(True)
        return pre

    # ------------------------------------------------------------------------------------------------ update
    def _update(
        self,
        batch: PaddedBatch,
        schedule: list[list[Rows]],
        pre: PreUpdate,
        advantages: torch.Tensor,
        returns: torch.Tensor | None,
    ) -> tuple[dict[str, float], float, float]:
        """Every epoch, every mini-batch: forward/backward its micro-batches, then one optimizer step (policy and
        critic). Returns (global stats, forward s, backward s). A micro-batch's backward is weighted by its share
        of its mini-batch's GLOBAL loss units; its stats by its share of the whole batch's, over the epochs."""
        algo, epochs = self.algo, self.algo.ppo_epochs
        units = self._sum_ranks_tensor(loss_units(batch.loss_mask, algo.aggregation)).clamp(min=1)
        tokens = self._sum_ranks_tensor(batch.loss_mask.sum().double()).clamp(min=1)
        mini_units = self._sum_ranks(
            np.array(
                [sum(float(loss_units(batch.loss_mask[rows], algo.aggregation)) for rows in mini) for mini in schedule]
            )
        )
        stats = GlobalAverages()
        shape = InputShape()
        forward_s = backward_s = 0.0
        for epoch in range(1, epochs + 1):
            for mini, mini_total in zip(schedule, mini_units):
                for i, rows in enumerate(mini):
                    start = time.perf_counter()
                    last = i == len(mini) - 1  # this micro-batch's backward ends the mini-batch: step after it
                    self.policy.begin_micro_batch(last)
                    inputs = batch.model_inputs(rows, self.device, self.packing, self.one_row)
                    shape.add(inputs)
                    mask, width = inputs.loss_mask, inputs.width
                    micro_units = loss_units(mask, algo.aggregation)
                    backward_share = float(micro_units) / max(float(mini_total), 1.0)  # of the step's loss
                    loss_share = float(micro_units / units) / epochs  # of the batch's loss units, per epoch
                    token_share = float(mask.sum() / tokens) / epochs  # ... of its action tokens
                    adv = advantages[rows, :width].to(self.device)  # [b, T']
                    loss = self._policy_objective(inputs, pre, adv, rows, stats, loss_share, token_share, epoch)
                    critic_loss = None
                    if self.critic is not None:
                        self.critic.begin_micro_batch(last)
                        old = pre.old_values[rows, :width].to(self.device)
                        target = returns[rows, :width].to(self.device)
                        values = self._critic_values(inputs)
                        critic_loss = value_objective(algo, values, old, target, mask, stats, loss_share, token_share)
                    forward_s += time.perf_counter() - start
                    start = time.perf_counter()
                    self.policy.backward(loss * backward_share * self.dist.world_size)
                    self.policy.step()
                    if critic_loss is not None:
                        self.critic.backward(critic_loss * backward_share * self.dist.world_size)
                        self.critic.step()
                    backward_s += time.perf_counter() - start
        return (
            {**stats.across_ranks(self._sum_ranks, self._max_ranks), **shape.metrics(self._sum_ranks, self._max_ranks)},
            forward_s,
            backward_s,
        )

    def _schedule(self, batch: PaddedBatch) -> list[list[Rows]]:
        """Per mini-batch, its micro-batches' rows: `micro_steps` equal slices, or (learner.max_tokens_per_micro_batch
        > 0) by token count, split until every rank has as many as the rank with the most (a collective)."""
        minis = mini_batch_rows(batch.size, self.mini_batches, self.micro_steps)
        if not self.token_budget:
            return minis
        tokens = batch.sample_tokens()
        over = int((tokens > self.token_budget).sum())
        if over:
            log.warning(
                "%d sample(s) longer than learner.max_tokens_per_micro_batch = %d (longest %d tokens): each gets a "
                "micro-batch of its own, over the budget; raise the budget to bound the memory",
                over,
                self.token_budget,
                int(tokens.max()),
            )
        whole = [slice(mini[0].start, mini[-1].stop) for mini in minis]
        bins = [token_budget_micro_batches(tokens, rows, self.token_budget, self.packing) for rows in whole]
        counts = self._max_ranks(np.array([len(b) for b in bins], dtype=np.float64))
        return [split_to_count(b, int(count)) for b, count in zip(bins, counts)]

    def _policy_objective(
        self,
        inputs: ModelInputs,
        pre: PreUpdate,
        advantages: torch.Tensor,
        part: Rows,
        stats: GlobalAverages,
        loss_share: float,
        token_share: float,
        epoch: int = 1,
    ) -> torch.Tensor:
        """`learners.objective.policy_objective` on the micro-batch of rows `part` (`advantages`: its [b, T']): the
        policy's forward with grad, and the rows' proximal and reference log-probs."""
        width = inputs.width
        logprobs, entropy = self._model_logprobs(self.policy, inputs)  # [b, T'] each
        proximal = logprobs.detach()  # one step per batch: the policy before the update IS the current one
        if self.steps_per_batch > 1:
            proximal = pre.logprobs[part, :width].to(self.device)  # taken before the batch's first step
        ref = None if pre.ref_logprobs is None else pre.ref_logprobs[part, :width].to(self.device)
        return policy_objective(
            self.algo, inputs, logprobs, entropy, proximal, ref, advantages, stats, loss_share, token_share, epoch
        )

    # ------------------------------------------------------------------------------------------------ helpers
    def _sum_ranks(self, values: np.ndarray) -> np.ndarray:
        return eng.all_reduce(torch.from_numpy(np.asarray(values, dtype=np.float64).copy()), "sum").numpy()

    def _max_ranks(self, values: np.ndarray) -> np.ndarray:
        return eng.all_reduce(torch.from_numpy(np.asarray(values, dtype=np.float64).copy()), "max").numpy()

    def _sum_ranks_tensor(self, value: torch.Tensor) -> torch.Tensor:
        return eng.all_reduce(value.double().reshape(1).clone(), "sum")[0]

    # ------------------------------------------------------------------------------------------------ weights
    def weight_layout(self) -> list[tuple[str, str, list[int]]]:
        """(name, dtype name, full shape) of every published tensor, in `full_weights` order (no gather)."""
        module = self.policy.module
        if self.lora is None:
            layout = [(name, p.dtype, list(getattr(p, "ds_shape", p.shape))) for name, p in module.named_parameters()]
        elif self.lora.sync == "adapter":
            layout = adapter_layout(module)
        else:
            layout = merged_layout(module)
        if self.lora is None or self.lora.sync != "adapter":  # checkpoint names: fused MoE experts split per expert
            layout = checkpoint_layout(module, layout)
        return [(name, str(dtype).removeprefix("torch."), shape) for name, dtype, shape in layout]

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors a weight update publishes (collective under ZeRO-3; each valid until the next is asked for):
        the policy's full weights by checkpoint name (`TrainEngine.full_weights`); with LoRA and learner.lora.sync =
        "merged" the same names and shapes with every adapted weight merged (`models.merged_weights`); with
        sync = "adapter" only the adapters' A and B matrices (`models.adapter_weights`, the header carries the
        adapter's settings: `learners.publisher`)."""
        if self.lora is not None and self.lora.sync == "adapter":
            return adapter_weights(self.policy.module, self.policy.zero3)
        return self._merged_weights()

    def _merged_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full weights by checkpoint name (`learners.checkpoint_names`), adapters merged (what the HF export
        writes)."""
        module = self.policy.module
        if self.lora is None:
            return checkpoint_weights(module, self.policy.full_weights())
        return checkpoint_weights(module, merged_weights(module, self.policy.zero3))

    # ------------------------------------------------------------------------------------------------ state
    def save_state(self, directory: Path) -> None:
        """DeepSpeed state of every engine into `directory/deepspeed` (with LoRA: the trainable parameters and
        their optimizer state), and (rank 0) the HF export into `directory/hf` (with LoRA: the merged model) and,
        with LoRA, the peft adapter into `directory/adapter` (`learners.checkpoint`). Collective."""
        self.policy.save(directory / "deepspeed", tag="policy")
        if self.critic is not None:
            self.critic.save(directory / "deepspeed", tag="critic")
        write = self.dist.rank == 0
        module = self.policy.module
        export_hf_model(directory / "hf", module.config, self.model_dir, self._merged_weights(), write=write)
        if self.lora is not None:
            adapter = module.peft_config[ADAPTER]
            export_adapter(directory / "adapter", adapter, adapter_weights(module, self.policy.zero3), write=write)

    def load_state(self, directory: Path) -> None:
        """Restore what `save_state` wrote (same world size, ZeRO stage and dtype: `check_resume_dtype` raises
        ValueError for another dtype before anything is loaded). Collective."""
        check_resume_dtype(directory, self.dtype, self.requested_dtype)
        self.policy.load(directory / "deepspeed", tag="policy")
        if self.critic is not None:
            self.critic.load(directory / "deepspeed", tag="critic")
