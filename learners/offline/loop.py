"""The offline stages: `tandem sft`, `tandem rm`, `tandem dpo`. One loop; what differs per stage (model, loss
and statistics of a micro-batch) is a small object of `learners.offline.stages`.

    tandem sft CONFIG                                   # supervised fine-tuning ([sft]: source, batch_size, ...)
    tandem rm CONFIG --rm.epochs 2                      # a reward model (Bradley-Terry) -> <run_dir>/model
    tandem dpo CONFIG --dpo.beta 0.1 --model.path runs/sft/model
    tandem sft CONFIG --learner.world_size 2            # data-parallel ranks (re-launched under torchrun)
    tandem sft CONFIG --learner.resume true             # continue from the newest complete checkpoint
    kill -INT <pid>                                     # stop after the step in flight, checkpoint, exit 130

They train with [learner]'s engine settings (lr, zero_stage, world_size, micro_batch_size, grad_clip,
warmup_steps, weight_decay, gradient_checkpointing, save_every, resume, cpu_cores) and the RL learner's code:
the DeepSpeed engine (`learners.engine`), checkpoints (`learners.checkpoint`), metrics (`learners.reporting`;
the stage's lines and summary.json in `learners.offline.report`),
signals and resume (`learners.session`), ranks (`learners.ranks`).

The loop, per step s (s = optimizer steps taken so far), on every rank:
    rows       the global batch of step s: rows [s B, (s + 1) B) of the row sequence (`Schedule`); this rank
               trains its contiguous share of B / world_size rows
    train_step one optimizer step on the global batch: each micro-batch of learner.micro_batch_size rows adds
               loss_sum / (the global batch's loss units) x world_size to the gradient (`learners.engine`'s
               convention), so the update equals one step on the whole batch for any micro-batch size and rank
               count; a pair is one row (its chosen and rejected replies go through one forward)
    eval       at step 0, every stage.eval_every steps and at the last: the held-out rows (each rank its share),
               `eval/<stage>/...` in the same record
    metrics    rank 0: one record per step (metrics.jsonl, TensorBoard), the progress bar and a log line
    checkpoint every learner.save_every steps, at the end, and on SIGINT/SIGTERM (then exit 128 + the signal)
At the end: the final weights as a Hugging Face directory `<run_dir>/model/` (written into model.tmp/, then
renamed: never half-written; SFT and DPO a causal LM, RM a one-label sequence-classification model) and
`<run_dir>/summary.json` (the first and the last evaluation).

Order: the row sequence is epoch 0's permutation of the training rows, then epoch 1's, ... (each drawn from
run.seed and the epoch alone), so the batch of a step depends on nothing else and a resumed run trains exactly
the batches of an uninterrupted one. Steps = ceil(epochs x rows / batch_size), at most max_steps; every step is
a whole batch (the last may reach into the next epoch's order).

Failure modes: a source without rows, or held-out rows fewer than the ranks, is a ValueError naming the key; a
resume needs the same world size and ZeRO stage (DeepSpeed's sharded state); every collective is called by
every rank in the same order (train steps, evaluations, checkpoints, the export), so a rank that dies makes
torchrun stop the others.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.config import TandemConfig, write_resolved
from common.logs import setup_logging
from common.run_dir import reuse_problem
from learners.checkpoint import CheckpointManager, LearnerState
from learners.offline.report import MODEL_DIR, eval_line, make_reporter, summary_line, write_summary
from learners.ranks import launch_ranks, pin_cores
from learners.session import Interrupt, Saves, any_rank, forget_steps_after, resume_state

KEEP_CHECKPOINTS = 2


def run_sft(config: TandemConfig) -> int:
    """`tandem sft CONFIG`: see the module docstring; the exit code."""
    return run_stage(config, "sft")


def run_rm(config: TandemConfig) -> int:
    """`tandem rm CONFIG`: see the module docstring; the exit code."""
    return run_stage(config, "rm")


def run_dpo(config: TandemConfig) -> int:
    """`tandem dpo CONFIG`: see the module docstring; the exit code."""
    return run_stage(config, "dpo")


# ------------------------------------------------------------------------------------------------ the order
@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, num_rows: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


@dataclass(frozen=True)
class Schedule:
    """Which training rows each step trains (see the module docstring: a function of the step alone)."""

    num_rows: int
    batch_size: int
    steps: int
    seed: int

    @classmethod
    def of(cls, num_rows: int, batch_size: int, epochs: float, max_steps: int, seed: int) -> Schedule:
        """ValueError when there are no rows (the stage's source is empty)."""
        if num_rows < 1:
            raise ValueError("no training rows: the stage's source holds none (or held_out keeps them all)")
        steps = max(1, math.ceil(round(epochs * num_rows, 6) / batch_size))  # round: 0.3 x 10 is not 3.0000000004
        return cls(num_rows, batch_size, min(steps, max_steps) if max_steps else steps, seed)

    def batch(self, step: int) -> list[int]:
        """The training rows (indices) of the global batch of `step` (0-based), in order."""
        first = step * self.batch_size
        return [
            int(_epoch_order(self.seed, i // self.num_rows, self.num_rows)[i % self.num_rows])
            for i in range(first, first + self.batch_size)
        ]

    def share(self, step: int, rank: int, world_size: int) -> list[int]:
        """Rank `rank`'s contiguous share of the batch of `step` (batch_size is a multiple of world_size)."""
        per_rank = self.batch_size // world_size
        return self.batch(step)[rank * per_rank : (rank + 1) * per_rank]

    def epoch(self, steps_done: int) -> float:
        """Passes over the training rows after `steps_done` steps."""
        return steps_done * self.batch_size / self.num_rows


# ------------------------------------------------------------------------------------------------ the trainer
class OfflineTrainer:
    """One stage's trainable model in a DeepSpeed engine; every method is collective across the ranks."""

    def __init__(self, config: TandemConfig, name: str, dist: Any) -> None:
        from transformers import AutoTokenizer

        from common.model_prep import resolve_model_path
        from learners import engine as eng
        from learners.models import torch_dtype, training_dtype
        from learners.offline.stages import make_stage

        stage_cfg = getattr(config, name)
        self.eng, self.dist, self.name = eng, dist, name
        self.model_dir = resolve_model_path(config.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.rank_rows = stage_cfg.batch_size // dist.world_size
        self.micro_batch_size = config.learner.micro_batch_size
        self.micro_steps = math.ceil(self.rank_rows / self.micro_batch_size)
        self.requested_dtype, self.dtype = config.model.dtype, training_dtype(config.model.dtype, eng.device())
        self.stage = make_stage(name, config, self.model_dir, self.tokenizer, eng.device(), torch_dtype(self.dtype))
        learner = config.learner
        settings = eng.EngineSettings(
            lr=learner.lr,
            zero_stage=learner.zero_stage,
            bf16=self.dtype == "bfloat16",
            micro_batch_size=self.micro_batch_size,
            micro_steps=self.micro_steps,
            weight_decay=learner.weight_decay,
            grad_clip=learner.grad_clip,
            warmup_steps=learner.warmup_steps,
            lr_schedule=learner.lr_schedule,
            min_lr_ratio=learner.min_lr_ratio,
        )
        self.engine = eng.TrainEngine(self.stage.model, settings)

    def tokenize(self, rows: Sequence[Any], max_len: int) -> list[Any]:
        return [self.stage.tokenize(self.tokenizer, row, max_len) for row in rows]

    def train_step(self, examples: Sequence[Any]) -> dict[str, float]:
        """One optimizer step on the global batch whose share on this rank is `examples` (module docstring);
        the metrics of the global batch, identical on every rank."""
        from learners.batching import split_rows

        if len(examples) != self.rank_rows:
            raise ValueError(f"{len(examples)} rows on this rank, the engine was built for {self.rank_rows}")
        units = self._sum_ranks({"units": float(self.stage.loss_units(examples))})["units"]
        scale = self.dist.world_size / max(units, 1.0)  # a micro-batch's loss sum -> its share of the mean x ranks
        sums: dict[str, float] = {}
        for part in split_rows(len(examples), self.micro_steps):
            loss_sum, micro_sums = self.stage.micro_batch(self.engine, examples[part])
            self.engine.backward(loss_sum * scale)
            self.engine.step()
            _accumulate(sums, micro_sums)
        totals = self._sum_ranks(sums)
        if self.engine.last_step_skipped:
            logging.getLogger("tandem.offline").warning(
                "a non-finite loss or gradient: this update was skipped (%d so far)", self.engine.skipped_steps
            )
        return {
            **self.stage.metrics(totals),
            "perf/samples": totals["rows"],
            "perf/tokens": totals["seq_tokens"],
            "policy/lr": self.engine.learning_rate(),
            "learner/steps_skipped_nonfinite": float(self.engine.skipped_steps),
        }

    def evaluate(self, examples: Sequence[Any]) -> dict[str, float]:
        """`eval/<stage>/...` of the held-out rows, no gradient, the model in eval mode meanwhile. Rank r scores
        rows [r k, (r + 1) k) with k = len(examples) // world_size, so every rank runs the same forwards (a
        ZeRO-3 forward is collective): the caller passes a multiple of the ranks."""
        import torch

        k = len(examples) // self.dist.world_size
        mine = examples[self.dist.rank * k : (self.dist.rank + 1) * k]
        sums: dict[str, float] = {}
        self.engine.train(False)
        try:
            with torch.no_grad():
                for start in range(0, len(mine), self.micro_batch_size):
                    _, micro_sums = self.stage.micro_batch(self.engine, mine[start : start + self.micro_batch_size])
                    _accumulate(sums, micro_sums)
        finally:
            self.engine.train(True)
        return {f"eval/{key}": value for key, value in self.stage.metrics(self._sum_ranks(sums)).items()}

    def _sum_ranks(self, sums: dict[str, float]) -> dict[str, float]:
        """`sums` added over the ranks (float64; collective: every rank passes the same keys)."""
        import torch

        keys = sorted(sums)
        total = self.eng.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64), "sum")
        return dict(zip(keys, total.tolist()))

    def save_state(self, directory: Path) -> None:
        """DeepSpeed state into `directory/deepspeed`, and (rank 0) the HF export into `directory/hf`."""
        self.engine.save(directory / "deepspeed", tag="policy")
        self.export(directory / "hf")

    def load_state(self, directory: Path) -> None:
        """Restore what `save_state` wrote; another dtype than the checkpoint's raises ValueError (resolved
        model.dtype: `learners.checkpoint.check_resume_dtype`)."""
        from learners.checkpoint import check_resume_dtype

        check_resume_dtype(directory, self.dtype, self.requested_dtype)
        self.engine.load(directory / "deepspeed", tag="policy")

    def export(self, directory: Path) -> None:
        """A Hugging Face directory of the current weights (rank 0 writes; the gather is collective)."""
        from learners.checkpoint import export_hf_model
        from learners.checkpoint_names import checkpoint_weights

        config = self.stage.model.config
        weights = checkpoint_weights(self.stage.model, self.engine.full_weights())
        export_hf_model(directory, config, self.model_dir, weights, write=self.dist.rank == 0)

    def export_final(self, target: Path) -> None:
        """`export` into `target.tmp`, then renamed to `target` (replacing an older one): never half-written."""
        tmp = target.with_name(target.name + ".tmp")
        if self.dist.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        self.export(tmp)
        if self.dist.rank == 0:
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        self.eng.barrier()


def _accumulate(sums: dict[str, float], more: dict[str, float]) -> None:
    for key, value in more.items():
        sums[key] = sums.get(key, 0.0) + value


# ------------------------------------------------------------------------------------------------ the loop
def run_stage(config: TandemConfig, name: str) -> int:
    """Train stage `name` (sft, rm, dpo; module docstring); the exit code: 0 done, 2 its run directory holds
    another run (`common.run_dir`), 128 + the signal when interrupted."""
    learner, run_dir = config.learner, config.run.run_dir
    if "RANK" not in os.environ:  # ranks were checked by the process that started them
        reused = reuse_problem(run_dir, learner.resume, whole_run=False)
        if reused:
            print(f"tandem {name}: {reused}", file=sys.stderr)
            return 2
        if learner.world_size > 1:
            return launch_ranks(config, name)
    log = setup_logging(name, int(os.environ.get("RANK", "0")), run_dir)
    trainer = _start_trainer(config, name)
    dist, stage_cfg = trainer.dist, getattr(config, name)
    train, held_out = _examples(trainer, config, name, log)
    schedule = Schedule.of(len(train), stage_cfg.batch_size, stage_cfg.epochs, stage_cfg.max_steps, config.run.seed)
    trainer.engine.decay_over(schedule.steps)  # learner.lr_schedule = cosine ends on the stage's last step
    if dist.rank == 0:
        write_resolved(config, run_dir)
    from learners.engine import barrier

    checkpoints = CheckpointManager(run_dir / "checkpoints", dist.rank, KEEP_CHECKPOINTS, barrier)
    state = resume_state(checkpoints, trainer, learner.resume, log)
    if dist.rank == 0 and learner.resume:
        forget_steps_after(run_dir / "metrics.jsonl", state.step, log)
    log.info(
        "%s: %d training rows, %d held out; %d steps of %d rows (%.2f epochs), micro-batches of %d",
        name,
        len(train),
        len(held_out),
        schedule.steps,
        schedule.batch_size,
        schedule.epoch(schedule.steps),
        trainer.micro_batch_size,
    )
    stop = Interrupt(log)
    reporter = make_reporter(config, name, schedule.steps, state.step, log) if dist.rank == 0 else None
    saves = Saves(
        checkpoints, trainer, learner.save_every, learner.save_on_interrupt, state.step if learner.resume else -1
    )
    try:
        _train_steps(trainer, schedule, (train, held_out), state, stop, reporter, saves, stage_cfg.eval_every)
        interrupted = saves.finish(state, stop, schedule.steps, log)
        if interrupted is not None:
            return interrupted
        trainer.export_final(run_dir / MODEL_DIR)
        if dist.rank == 0:
            summary = write_summary(run_dir, name, schedule.steps)
            log.info("done: %d steps; %s; the model is in %s", state.step, summary_line(summary), run_dir / MODEL_DIR)
    finally:
        stop.restore()
        if reporter is not None:
            reporter.close()
    return 0


def _train_steps(
    trainer: OfflineTrainer,
    schedule: Schedule,
    examples: tuple[list[Any], list[Any]],
    state: LearnerState,
    stop: Interrupt,
    reporter: Any,
    saves: Saves,
    eval_every: int,
) -> None:
    """The steps from state.step to schedule.steps, or until a signal (every rank stops after the same step):
    the held-out evaluation first on a fresh run, then per step its record (rank 0's `reporter`, None on the
    others) with the evaluation when `_evaluates`, and the save_every checkpoints. Collective."""
    train, held_out = examples
    name = trainer.name
    if state.step == 0 and held_out:
        evaluation = trainer.evaluate(held_out)
        if reporter is not None:
            reporter.note(0, evaluation, f"held-out {eval_line(name, evaluation)}")
    while state.step < schedule.steps:
        if any_rank(stop.requested()):
            break
        start = time.perf_counter()
        record = _train_one_step(trainer, schedule, train, state)
        if held_out and _evaluates(state.step, schedule.steps, eval_every):
            eval_start = time.perf_counter()
            record.update(trainer.evaluate(held_out))
            record["perf/eval_s"] = time.perf_counter() - eval_start
        record[f"{name}/epoch"] = schedule.epoch(state.step)
        record["perf/step_s"] = time.perf_counter() - start
        if reporter is not None:
            reporter.report(state.step, record)
        saves.after_step(state)


def _start_trainer(config: TandemConfig, name: str) -> OfflineTrainer:
    """Join the process group, pin this rank's cores, seed torch with run.seed (the RM's fresh head is drawn from
    it: the same on every rank and in every run) and build the stage's trainer."""
    import torch

    from learners.engine import init_distributed

    dist = init_distributed()
    if dist.world_size != config.learner.world_size:
        raise ValueError(
            f"learner.world_size = {config.learner.world_size}, but this process group has {dist.world_size} "
            f"ranks (WORLD_SIZE); launch with `tandem {name}` and no RANK set, or make them agree"
        )
    pin_cores(config.learner.cpu_cores, dist.local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size)))
    torch.manual_seed(config.run.seed)
    return OfflineTrainer(config, name, dist)


def _examples(
    trainer: OfflineTrainer, config: TandemConfig, name: str, log: logging.Logger
) -> tuple[list[Any], list[Any]]:
    """(training examples, held-out examples), tokenized with max_len = model.max_model_len; the held-out ones
    cut to a multiple of the ranks (each rank evaluates the same number)."""
    rows, eval_rows = trainer.stage.rows()
    max_len = config.model.max_model_len
    train, held_out = trainer.tokenize(rows, max_len), trainer.tokenize(eval_rows, max_len)
    world = trainer.dist.world_size
    if held_out and len(held_out) < world:
        raise ValueError(
            f"{name}: {len(held_out)} held-out rows for {world} ranks: give {name}.num_eval_examples (or the "
            f"held-out source) at least learner.world_size rows"
        )
    if len(held_out) % world:
        kept = len(held_out) // world * world
        log.warning("%s: %d held-out rows evaluated of %d (a multiple of the ranks)", name, kept, len(held_out))
    if not held_out:
        log.warning("%s: no held-out rows (held_out = 0 and no eval_source): no evaluation", name)
    cut = sum(example.truncated for example in train + held_out)
    if cut:
        log.warning("%s: %d rows longer than model.max_model_len = %d were cut from the right", name, cut, max_len)
    return train, held_out[: len(held_out) // world * world]


def _evaluates(step: int, steps: int, eval_every: int) -> bool:
    """Whether the held-out rows are evaluated after `step` (step 0 is evaluated before the loop)."""
    return step == steps or (eval_every > 0 and step % eval_every == 0)


def _train_one_step(
    trainer: OfflineTrainer, schedule: Schedule, train: list[Any], state: LearnerState
) -> dict[str, Any]:
    """Train step `state.step` and count it; the step's record (its metrics and timings)."""
    start = time.perf_counter()
    examples = [train[i] for i in schedule.share(state.step, trainer.dist.rank, trainer.dist.world_size)]
    stats = trainer.train_step(examples)
    train_s = time.perf_counter() - start
    state.step += 1
    state.policy_version = state.step
    state.samples_trained += int(stats["perf/samples"])
    state.tokens_trained += int(stats["perf/tokens"])
    return {
        **stats,
        "perf/train_s": train_s,
        "perf/train_tokens_per_s": stats["perf/tokens"] / max(train_s, 1e-9),
        "learner/samples_trained": state.samples_trained,
        "learner/tokens_trained": state.tokens_trained,
    }
