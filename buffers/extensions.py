"""The buffer core's seam for optional work beside training: evaluation today (`buffers.eval_extension`, on the scheduler of `buffers.evaluation`).

`buffers.core.BufferCore` answers a lease request from a short chain of grant sources; the first that answers wins:
    1. run end      the learner's final report came and no extension holds the end: `RunOver`
    2. extensions   each one's `lease_reply` (evaluation: an `EvalGrant` when a round is due for that generator;
                    while the final round is waited for, a refusal instead of training prompts), or None to pass
    3. training     the prompt dispenser and admission control: a `LeaseGrant` or a `LeaseRefused`
An extension also
    handlers        answers messages of its own (evaluation: `EvalResult`), merged into the core's table
    heard           hears every heartbeat (with whether its generator is making progress) to renew its leases
    version_reported  hears every version report, after the run end has taken it
    tick            runs at each housekeeping tick, given the generators that are silent or stuck
    holds_end       holds the run's end (`RunOver`) while its work on the final version is not done
    end_pending     how many of its pieces the end still waits for (the `end_pending` counter the learner polls
                    to keep its weights published until then: `learners.learner`)
    counters        adds its counters to the buffer's
    open_sink / flush / close   writes rows of its own (evaluation: eval.jsonl), flushed after every request
`default_extensions` builds what the state was built with; with none, the core is training alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from common.types import Heartbeat, LeaseRequest, VersionReport

if TYPE_CHECKING:
    from buffers.run_end import RunEnd
    from buffers.state import BufferState
    from common.trackers import Trackers

Handler = Callable[[Any, Any, str, float], list[tuple[Any, Any]]]  # (message, reply_to, sender, now) -> replies


class CoreExtension:
    """See the module docstring; each hook does nothing here, so an extension defines only the ones it uses.
    Single-threaded: the buffer's poll loop."""

    handlers: Mapping[type, Handler] = MappingProxyType({})

    def lease_reply(self, request: LeaseRequest, sender: str, now: float) -> Any | None:
        return None

    def heard(self, heartbeat: Heartbeat, progressing: bool, now: float) -> None:
        pass

    def version_reported(self, report: VersionReport, now: float) -> None:
        pass

    def tick(self, now: float, unresponsive: list[int]) -> None:
        pass

    def holds_end(self, now: float) -> bool:
        return False

    def end_pending(self) -> int:
        return 0

    def counters(self) -> dict[str, int]:
        return {}

    def open_sink(self, run_dir: Path, start_time: float, simulation: bool, trackers: Trackers) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def default_extensions(state: BufferState, end: RunEnd) -> list[CoreExtension]:
    """The extensions `state` was built for: evaluation, on its scheduler when it has one (eval.sets), else the
    refusal of eval results that a buffer without evaluation gives."""
    from buffers.eval_extension import BufferEvaluation, NoEvaluation

    return [BufferEvaluation(state, end) if state.evaluation is not None else NoEvaluation()]
