"""The learner role: DeepSpeed data-parallel ranks that pull batches, train, publish weights and checkpoint.

    tandem learner CONFIG                                  # world_size ranks (re-launched under torchrun if > 1)
    tandem learner CONFIG --learner.zero_stage 3 --learner.world_size 2
    tandem learner CONFIG --learner.resume true            # continue from the newest complete checkpoint
    kill -INT <pid>                                        # stop after the step in flight, checkpoint, exit 130
    tandem learner CONFIG --run.simulate true              # SIMULATION: no model, real sockets and versions

The loop, per step s (s = batches trained so far = the policy_version the step trains at; one step is
algo.ppo_epochs x learner.mini_batches optimizer steps on its batch):
    batch      <- buffer: this rank's share of the batch for step s (BatchNotReady: ask again; buffer down: back off)
    train_step -> the update on the global batch (learners.trainer), s <- s + 1
    publish    every sync_every steps (and at the last): weights of version s, then rank 0 sends VersionReport(s, s)
               (`final` at learner.total_steps: the buffer ends the run, telling the generators to exit)
    metrics    rank 0: one record per step (metrics.jsonl, TensorBoard), progress bar, a log line
    checkpoint every save_every steps, at the end, and on SIGINT/SIGTERM (learners.checkpoint)
A wait for a batch longer than learner.wait_report_s (and 3x the median step time) is explained in one line, in the
log and in waiting.jsonl (`tandem run` prints it), then every few minutes while it lasts (`learners.stall_report`).
After the last step, rank 0 keeps its weights published while the buffer's end waits for work on the final
version (its counter end_pending, polled every END_POLL_S, is 0 once that is done: a final evaluation round, with
eval.sets and eval.at_end), until the buffer stops answering, config.learner_end_wait_s passed (0: no wait), or a
signal came. The learner knows nothing of what that work is; the training itself never waits for it.

Interruption: SIGINT or SIGTERM is recorded, not obeyed at once. The loop stops before its next batch (a wait for
the buffer is cut short: `learners.buffer_link.LinkInterrupted`), every rank at the same step (one all-reduce of a
flag per step), saves a checkpoint unless learner.save_on_interrupt = false, and exits 128 + the signal (130 for
SIGINT, 143 for SIGTERM). A second SIGINT raises KeyboardInterrupt at once, without a checkpoint. A resume drops
the records of steps after its checkpoint from metrics.jsonl (they are trained again), so no step appears twice.

Versions: the weights at start (step 0, or the step a resume continues from) are published first with version
= that step, so a generator that (re)starts always finds weights; a resume keeps the numbering. Rank 0 announces
that step to the buffer (`resync`), which may move the buffer's view back to an older checkpoint's step.
Failure modes: a dead buffer is waited for (backoff, logged); a refused request is counted and retried, rank 0
re-announcing its step first (`learners.buffer_link`), until refusals outlast the link's patience or say the
learner's key or config is wrong: then it stops with the buffer's reason (`BufferRefused`); a malformed batch, a
protocol error or an engine error ends the learner with the error (a later `--learner.resume true` continues
from the last checkpoint).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from common.config import TandemConfig, write_resolved
from common.logs import setup_logging
from common.run_dir import reuse_problem
from common.sockets import SocketSecurity
from common.trackers import Trackers
from common.types import Batch, RolloutGroup
from learners.buffer_link import BufferLink, BufferRefused, LinkInterrupted
from learners.checkpoint import CheckpointManager, LearnerState
from learners.publisher import WeightsPublisher, open_weights_publisher
from learners.ranks import launch_ranks, pin_cores
from learners.session import Interrupt, Saves, any_rank, forget_steps_after, resume_state
from learners.stall_report import WAITING_STREAM, BatchNeeds, WaitWatch

KEEP_CHECKPOINTS = 2
END_POLL_S = 1.0


class StepTrainer(Protocol):
    """What the loop needs from a trainer: `learners.trainer.Trainer` (DeepSpeed) or the simulation
    (`learners.sim_trainer.SimulatedTrainer`). Every call is collective across data-parallel ranks."""

    def train_step(self, groups: Sequence[RolloutGroup], staleness: Sequence[np.ndarray]) -> dict[str, float]: ...

    def weight_layout(self) -> list[tuple[str, str, list[int]]]: ...

    def full_weights(self) -> Iterator[tuple[str, Any]]: ...

    def save_state(self, directory: Path) -> None: ...

    def load_state(self, directory: Path) -> None: ...


def run(config: TandemConfig) -> int:
    """Train `learner.total_steps` steps (see the module docstring); returns the process exit code: 0 done, 1 the
    buffer refused it, 2 its run directory holds another run (`common.run_dir`), 128 + signal when interrupted."""
    reused = None if "RANK" in os.environ else reuse_problem(config.run.run_dir, config.learner.resume, whole_run=False)
    if reused:  # a learner started by hand (ranks and Ray members were checked by what started them)
        print(f"tandem learner: {reused}", file=sys.stderr)
        return 2
    if config.learner.world_size > 1 and "RANK" not in os.environ and not config.run.simulate:
        return launch_ranks(config)
    learner = Learner(config)
    try:
        learner.start()
        while learner.state.step < config.learner.total_steps and learner.step():
            pass
        return learner.finish()
    except LinkInterrupted as interruption:  # rank 0's first announcement, while the buffer was away
        learner.log.warning("%s at step %d: stopping", interruption, learner.state.step)
        return 128 + learner.stop.signum
    except BufferRefused as refusal:  # refused for longer than the link's patience, or for good: say why, and stop
        learner.log.error(
            "stopping at step %d: %s (last checkpoint: --learner.resume true continues from it)",
            learner.state.step,
            refusal,
        )
        return 1
    finally:
        learner.close()


class Learner:
    """One rank of the learner: what it holds (trainer, checkpoints, state, the buffer link, rank 0's publisher,
    reporter and wait watch) and its phases as methods; `run` above is the loop (the module docstring)."""

    def __init__(self, config: TandemConfig) -> None:
        self.config = config
        self.settings = learner = config.learner
        run_dir = config.run.run_dir
        self.log = setup_logging("learner", int(os.environ.get("RANK", "0")), run_dir, simulation=config.run.simulate)
        self.trainer, self.dist = _start_trainer(config)
        self.rank0 = self.dist.rank == 0
        if self.rank0:
            write_resolved(config, run_dir)
        self.checkpoints = CheckpointManager(
            run_dir / "checkpoints", self.dist.rank, KEEP_CHECKPOINTS, _barrier(config)
        )
        self.state = resume_state(self.checkpoints, self.trainer, learner.resume, self.log)
        if self.rank0 and learner.resume:
            forget_steps_after(run_dir / "metrics.jsonl", self.state.step, self.log)
        security = SocketSecurity.from_run(config.run)
        self.publisher: WeightsPublisher | None = None
        if self.rank0:
            self.publisher = open_weights_publisher(
                config.weights, learner.weights_host, learner.weights_port, security, lora=learner.lora
            )
        self.stop = Interrupt(self.log)
        self.buffer = BufferLink(
            learner.buffer_address,
            security,
            self.dist.rank,
            self.dist.world_size,
            learner.groups_per_step,
            interrupted=self.stop.requested,
        )
        self.reporter: Any = None
        self.watch = _SaidWatch(config, self.buffer, self.log) if self.rank0 else None
        self.saves: Saves | None = None

    def start(self) -> None:
        """Publish the weights the run starts from and announce their version (a finished run resumed ends again)."""
        _publish(self.trainer, self.publisher, self.state.step)
        if self.rank0:
            final = self.state.step >= self.settings.total_steps
            self.buffer.report_version(self.state.policy_version, self.state.step, resync=True, final=final)
            self.reporter = _reporter(self.config, self.state, self.log)
        resumed_at = self.state.step if self.settings.resume else -1
        self.saves = Saves(
            self.checkpoints, self.trainer, self.settings.save_every, self.settings.save_on_interrupt, resumed_at
        )

    def step(self) -> bool:
        """One step: fetch this rank's share of the batch, train on it, publish when due, record, checkpoint when
        due. False, having trained nothing, when the ranks stop instead (interrupted, or the buffer is gone)."""
        step_start = time.perf_counter()
        fetched = _fetch_unless_interrupted(self.buffer, self.state.step, self.watch)
        if any_rank(fetched is None, self.config.run.simulate):  # every rank stops after the same step
            return False
        batch, wait_s = fetched
        train_start = time.perf_counter()
        stats = self.trainer.train_step(batch.groups, batch.staleness)
        train_s = time.perf_counter() - train_start
        _count_consumed(self.state, stats)
        publish_s = self._publish_if_due()
        timings = {
            "perf/wait_s": wait_s,
            "perf/train_s": train_s,
            "perf/publish_s": publish_s,
            "perf/step_s": time.perf_counter() - step_start,
        }
        self._record(stats, timings, batch)
        self.saves.after_step(self.state)
        return True

    def _publish_if_due(self) -> float:
        """Every sync_every steps and at the last: publish version = step and (rank 0) report it. Seconds spent."""
        step, total = self.state.step, self.settings.total_steps
        if step % self.settings.sync_every != 0 and step != total:
            return 0.0
        publish_s = _publish(self.trainer, self.publisher, step)
        self.state.policy_version = step
        if self.rank0:
            _report_version(self.buffer, self.state, step == total, self.log)
        return publish_s

    def _record(self, stats: dict[str, float], timings: dict[str, float], batch: Batch) -> None:
        """Rank 0: the step's metrics record (and the wait watch's step time)."""
        if self.publisher is not None:  # bytes out of rank 0 for weights so far: k x the model per update by relay
            timings["weights/publisher_bytes"] = float(getattr(self.publisher, "counters", {}).get("served_bytes", 0))
            # weights requests refused so far (malformed, forbidden, or a fault while answering: common.serving)
            timings["weights/publisher_rejected"] = float(sum(getattr(self.publisher, "rejected", {}).values()))
        if self.reporter is not None:
            self.reporter.report(self.state.step, _record(stats, timings, self.state, *_buffer_counters(batch)))
        if self.watch is not None:
            self.watch.stepped(timings["perf/step_s"])

    def finish(self) -> int:
        """After the loop: the final (or interrupt) checkpoint, then rank 0 keeps its weights published until the
        buffer's end no longer waits for work on the final version. The exit code: 0, or 128 + signal when
        interrupted."""
        interrupted = self.saves.finish(self.state, self.stop, self.settings.total_steps, self.log)
        if interrupted is not None:
            return interrupted
        self.log.info(
            "done: %d steps, policy_version %d, %d samples trained",
            self.state.step,
            self.state.policy_version,
            self.state.samples_trained,
        )
        if self.rank0 and self.config.learner_end_wait_s > 0:
            _wait_for_run_end(self.buffer, self.config.learner_end_wait_s, self.stop.requested, self.log)
        return 0

    def close(self) -> None:
        self.stop.restore()
        self.buffer.close()
        for part in (self.publisher, self.reporter, self.watch):
            if part is not None:
                part.close()


class _SaidWatch(WaitWatch):
    """Rank 0's watch of its waits for batches: a due report goes to the log and to waiting.jsonl."""

    def __init__(self, config: TandemConfig, buffer: BufferLink, log: logging.Logger) -> None:
        super().__init__(BatchNeeds.from_config(config), first_after_s=config.learner.wait_report_s)
        self.buffer, self.log, self.run_dir, self.sink = buffer, log, config.run.run_dir, None

    def on_wait(self, step: int) -> Callable[[float], None]:
        def waited(waited_s: float) -> None:
            report = self.waiting(step, waited_s, self.buffer.stats)
            if report is None:
                return
            self.log.warning("%s", report.line)
            if self.sink is None:
                from common.metrics import MetricsSink

                self.sink = MetricsSink(self.run_dir, stream=WAITING_STREAM, tensorboard=False)
            self.sink.log(step, {**report.values, "message": report.line})

        return waited

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()


def _fetch_unless_interrupted(buffer: BufferLink, step: int, watch: _SaidWatch | None) -> tuple[Any, float] | None:
    """(batch, wait_s) for `step`, or None when the learner was interrupted before or while waiting for it."""
    try:
        return buffer.fetch_batch(step, on_wait=None if watch is None else watch.on_wait(step))
    except LinkInterrupted:
        return None


def _report_version(buffer: BufferLink, state: LearnerState, final: bool, log: logging.Logger) -> None:
    """Rank 0's report of a published version; an interruption while the buffer is away skips it (the next start
    announces the step anyway), and the loop then stops before its next batch."""
    try:
        buffer.report_version(state.policy_version, state.step, final=final)
    except LinkInterrupted as interruption:
        log.warning("%s: the version of step %d is not reported", interruption, state.step)


def _wait_for_run_end(
    buffer: BufferLink, timeout_s: float, interrupted: Callable[[], bool], log: logging.Logger
) -> None:
    """Keep the publisher up (return later) while the buffer's end waits for work on the final version, until that
    is done, the buffer no longer answers, `timeout_s` passed or the learner is interrupted; logs which ended it."""
    start = time.monotonic()
    log.info("waiting for the buffer's end (at most %.0fs; the weights stay published)", timeout_s)
    while True:
        pending = buffer.end_pending()
        waited = time.monotonic() - start
        if pending == 0:
            log.info("the buffer's end waits for nothing more after %.1fs", waited)
            return
        if pending is None:
            log.info("the buffer no longer answers (it ended the run): not waiting")
            return
        if waited >= timeout_s or interrupted():
            why = "interrupted" if interrupted() else f"{timeout_s:.0f}s passed"
            log.warning("the buffer's end still waits for %d pieces of work, %s: stopping anyway", pending, why)
            return
        deadline = time.monotonic() + min(END_POLL_S, max(0.0, timeout_s - waited))
        while time.monotonic() < deadline and not interrupted():
            time.sleep(0.05)


def _start_trainer(config: TandemConfig) -> tuple[StepTrainer, Any]:
    """(trainer, DistInfo): the simulated trainer as one process, or a DeepSpeed rank in the process group."""
    from learners.engine import DistInfo

    if config.run.simulate:
        from learners.sim_trainer import SimulatedTrainer

        return SimulatedTrainer(config.learner, config.algo), DistInfo(rank=0, world_size=1, local_rank=0)
    from learners.engine import init_distributed
    from learners.trainer import Trainer

    dist = init_distributed()
    if dist.world_size != config.learner.world_size:
        raise ValueError(
            f"learner.world_size = {config.learner.world_size}, but this process group has "
            f"{dist.world_size} ranks (WORLD_SIZE); launch with `tandem learner` and no RANK set, "
            "or make them agree"
        )
    pin_cores(config.learner.cpu_cores, dist.local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", dist.world_size)))
    return Trainer.from_config(config, dist), dist


def _barrier(config: TandemConfig) -> Callable[[], None]:
    if config.run.simulate:
        return lambda: None
    from learners.engine import barrier

    return barrier


def _publish(trainer: StepTrainer, publisher: WeightsPublisher | None, version: int) -> float:
    """Publish the trainer's weights as `version` (rank 0); other ranks take part in the ZeRO-3 gathers."""
    start = time.perf_counter()
    if publisher is not None:
        publisher.publish(version, trainer.weight_layout(), trainer.full_weights())
    else:
        for _ in trainer.full_weights():
            pass
    return time.perf_counter() - start


def _reporter(config: TandemConfig, state: LearnerState, log: logging.Logger) -> Any:
    from learners.reporting import StepReporter

    return StepReporter(
        config.run.run_dir,
        config.learner.total_steps,
        state.step,
        log,
        simulation=config.run.simulate,
        trackers=Trackers.from_config(config),
    )


def _count_consumed(state: LearnerState, stats: dict[str, float]) -> None:
    state.step += 1
    state.samples_trained += int(stats["perf/samples"])
    state.tokens_trained += int(stats["perf/tokens"])
    state.groups_trained += int(stats["perf/groups"])


def _buffer_counters(batch: Batch) -> tuple[int, int, float]:
    """The buffer's cumulative counters a batch carries: dropped_stale, dropped_no_signal, no_signal_reward_sum."""
    return batch.dropped_stale, batch.dropped_no_signal, batch.no_signal_reward_sum


def _record(
    stats: dict[str, float],
    timings: dict[str, float],
    state: LearnerState,
    dropped_stale: int,
    dropped_no_signal: int = 0,
    no_signal_reward_sum: float = 0.0,
) -> dict[str, Any]:
    """The step's metrics record. The buffer's counters are cumulative, as of the batch's draw: with dynamic
    sampling, the filtered samples and their reward sum give benchmarks.time_to_reward the mean reward of every
    generated sample (reward/mean covers only the groups with signal)."""
    return {
        "policy_version": state.policy_version,
        **stats,
        **timings,
        "perf/train_tokens_per_s": stats["perf/tokens"] / max(timings["perf/train_s"], 1e-9),
        "buffer/dropped_stale": dropped_stale,
        "buffer/dropped_no_signal": dropped_no_signal,
        "buffer/no_signal_reward_sum": no_signal_reward_sum,
        "learner/samples_trained": state.samples_trained,
        "learner/tokens_trained": state.tokens_trained,
    }
