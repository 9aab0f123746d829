"""What every training session does around its steps, for the RL learner (`learners.learner`) and the offline
stages (`learners.offline.loop`): stop at a step boundary on a signal, resume from a checkpoint, keep each step once.

    stop = Interrupt(log)                                   # SIGINT/SIGTERM recorded, not obeyed at once
    state = resume_state(checkpoints, trainer, resume, log) # LearnerState() or the newest complete checkpoint's
    forget_steps_after(run_dir / "metrics.jsonl", state.step, log)   # rank 0, on a resume
    saves = Saves(checkpoints, trainer, save_every, save_on_interrupt, state.step if resume else -1)
    while ...:
        if any_rank(stop.requested()): break                # collective: every rank stops after the same step
        ...; saves.after_step(state)                        # every learner.save_every steps
    code = saves.finish(state, stop, total_steps, log)      # the last checkpoint; 128 + the signal, or None

Interruption: the first SIGINT or SIGTERM is recorded (`signum`) and logged; the loop stops before its next step
on every rank together (`any_rank`, one all-reduce of a flag), checkpoints unless learner.save_on_interrupt is
false, and exits 128 + the signal (130 for SIGINT, 143 for SIGTERM). A second SIGINT raises KeyboardInterrupt at
once, without a checkpoint. The handlers are installed only in the main thread (where Python delivers signals);
`restore()` puts the previous ones back.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from learners.checkpoint import Checkpointable, CheckpointManager, LearnerState, trim_records


class Interrupt:
    """Records SIGINT/SIGTERM for the loop to stop after the step in flight (see the module docstring)."""

    def __init__(self, log: logging.Logger) -> None:
        self.signum = 0
        self.log = log
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def requested(self) -> bool:
        return self.signum != 0

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now, without a checkpoint
        if not self.signum:
            self.log.warning(
                "%s: stopping after the step in flight (a second SIGINT stops at once, without a checkpoint)",
                signal.Signals(signum).name,
            )
            self.signum = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def any_rank(stopping: bool, simulate: bool = False) -> bool:
    """Whether any rank is stopping. Collective (every rank calls it once per step, so all stop together), except
    with `simulate` (one process, no process group)."""
    if simulate:
        return stopping
    import torch

    from learners.engine import all_reduce, device

    return bool(all_reduce(torch.tensor([float(stopping)], device=device()), op="max").item())


def resume_state(
    checkpoints: CheckpointManager, trainer: Checkpointable, resume: bool, log: logging.Logger
) -> LearnerState:
    """LearnerState() without `resume` or without a complete checkpoint (said in the log), else the newest
    complete checkpoint restored into `trainer` (collective), its policy_version = its step."""
    if not resume:
        return LearnerState()
    latest = checkpoints.latest()
    if latest is None:
        log.warning(
            "learner.resume = true but %s holds no complete checkpoint: the run starts again at step 0",
            checkpoints.root,
        )
        return LearnerState()
    state = checkpoints.load(latest, trainer)
    state.policy_version = state.step  # the restored weights are this step's version
    return state


def forget_steps_after(metrics_path: Path, step: int, log: logging.Logger) -> None:
    """Drop the records of steps after the resumed one: they are trained again, and must not appear twice."""
    dropped = trim_records(metrics_path, step)
    if dropped:
        log.warning(
            "resuming at step %d: %d records of later steps dropped from %s (trained again now)",
            step,
            dropped,
            metrics_path,
        )


@dataclass
class Saves:
    """The session's checkpoints: every `save_every` steps (0 = none on the way), and once at the end of the loop
    for a step not saved yet, unless a signal stopped it and `save_on_interrupt` is false. `saved_step` is the
    step the newest checkpoint holds (-1: none yet; a resumed session passes the step it resumed from)."""

    checkpoints: CheckpointManager
    trainer: Checkpointable
    save_every: int
    save_on_interrupt: bool
    saved_step: int = -1

    def after_step(self, state: LearnerState) -> None:
        """Checkpoint `state` when its step is a multiple of save_every (collective)."""
        if self.save_every and state.step % self.save_every == 0:
            self.checkpoints.save(self.trainer, state)
            self.saved_step = state.step

    def finish(self, state: LearnerState, stop: Interrupt, total_steps: int, log: logging.Logger) -> int | None:
        """After the loop: checkpoint the last step (see the class docstring; collective); 128 + the signal when
        `stop` ended the loop before `total_steps` (`interrupted_exit`), else None (the session goes on to end)."""
        if state.step > 0 and self.saved_step != state.step and (not stop.signum or self.save_on_interrupt):
            self.checkpoints.save(self.trainer, state)
            self.saved_step = state.step
        if stop.signum and state.step < total_steps:
            return interrupted_exit(stop, state.step, self.saved_step, self.checkpoints, total_steps, log)
        return None


def interrupted_exit(
    stop: Interrupt,
    step: int,
    saved_step: int,
    checkpoints: CheckpointManager,
    total_steps: int,
    log: logging.Logger,
) -> int:
    """Say what a resume continues from; the exit code 128 + the signal."""
    name = signal.Signals(stop.signum).name
    if saved_step == step and step > 0:
        log.warning(
            "%s at step %d/%d: checkpoint %s holds it; --learner.resume true continues from there",
            name,
            step,
            total_steps,
            checkpoints.root / f"step-{step:06d}",
        )
    else:
        latest = checkpoints.latest()
        log.warning(
            "%s at step %d/%d, no checkpoint saved (%s): --learner.resume true continues from %s",
            name,
            step,
            total_steps,
            "learner.save_on_interrupt = false" if step > 0 else "nothing trained yet",
            latest if latest is not None else "step 0 (no checkpoint yet)",
        )
    return 128 + stop.signum
