"""Evaluation as an extension of the buffer core (`buffers.extensions`): what `buffers.evaluation.EvalScheduler`
(rounds, eval leases, results) needs from the lease chain, the message table, heartbeats, version reports, the tick,
the run's end and a sink of its own (eval.jsonl). A buffer without eval sets gets `NoEvaluation`."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from buffers.checks import RequestRejected
from buffers.extensions import CoreExtension
from buffers.staleness import RETRY_FULL_S, RETRY_STALE_S
from common.eval_messages import EvalResult
from common.metrics import MetricsSink
from common.types import Heartbeat, LeaseRefused, LeaseRequest, VersionReport

if TYPE_CHECKING:
    from buffers.run_end import RunEnd
    from buffers.state import BufferState
    from common.trackers import Trackers

log = logging.getLogger("tandem.buffer.eval")


class BufferEvaluation(CoreExtension):
    """Evaluation as an extension of the buffer core (`buffers.extensions`): the scheduler's grants in the lease
    chain, the `EvalResult` handler, lease renewal by heartbeat, rounds opened by version reports, expiry at each
    tick, the hold on the run's end while the final round is not done, and eval.jsonl.

    Eval grants wait for the run's first training batch (on a slow machine an eval round sampled first, hundreds
    of requests, would delay the learner's first step by as long as it takes; rounds stay due). With eval.at_end,
    after the learner's final report, lease requests get eval grants or a refusal ('stale' with the final version
    for a generator on older weights, else 'full'), never training prompts, until the final round is done."""

    def __init__(self, state: BufferState, end: RunEnd) -> None:
        assert state.evaluation is not None
        self.state, self.end, self.scheduler = state, end, state.evaluation
        self.handlers = {EvalResult: self._result}
        self.sink: MetricsSink | None = None

    def lease_reply(self, request: LeaseRequest, sender: str, now: float) -> Any | None:
        if not (self.state.drawn_high > 0 or self.end.over):
            return None
        grant = self.scheduler.grant(request.generator_id, request.policy_version, now, holder=sender)
        if grant is not None:
            self.state.record_eval(now)
            return grant
        if self.end.over:  # the final round is still waited for: no more training prompts
            stale = self.scheduler.stale_for_final(request.policy_version)
            if stale is not None:
                return LeaseRefused("stale", stale, RETRY_STALE_S)
            return LeaseRefused("full", request.policy_version, RETRY_FULL_S)
        return None

    def _result(self, result: EvalResult, reply_to: Any, sender: str, now: float) -> list[tuple[Any, Any]]:
        """Checked against its eval lease: accepted (a row for eval.jsonl), duplicate, or rejected with the reason
        (counted `rejected_eval_<kind>`; the set is due again)."""
        lease = self.scheduler.leases.get(result.lease_id)
        if lease is not None and lease.generator_id == result.generator_id:
            self.state.dispenser.seen(result.generator_id, now)
        ack = self.scheduler.receive(result, now, self.state.learner_version, self.state.newest_version, sender)
        self.state.record_eval(now)
        if ack.status == "rejected":
            log.warning("rejected eval result of lease %d from %s: %s", result.lease_id, sender, ack.reason)
        return [(reply_to, ack)]

    def heard(self, heartbeat: Heartbeat, progressing: bool, now: float) -> None:
        """A heartbeat listing the eval lease renews it, as it renews training leases (while progress is made)."""
        if progressing:
            self.scheduler.renew(heartbeat.generator_id, heartbeat.eval_lease_ids, now)

    def version_reported(self, report: VersionReport, now: float) -> None:
        """A version opens a round when it is due (every eval.every versions, the final one with eval.at_end); a
        resync that reopens the run reopens its final round."""
        if self.scheduler.report_version(report.policy_version, report.final, now):
            self.state.record_eval(now)
        if report.resync and not report.final and self.scheduler.reopen():
            self.state.record_eval(now)

    def tick(self, now: float, unresponsive: list[int]) -> None:
        """Expire eval leases past their deadline or held by silent or stuck generators (their set is due again),
        give up on a final round past eval.final_timeout_s, forget finished rounds."""
        expired = self.scheduler.expire(now, unresponsive)
        gave_up = self.scheduler.check_final_timeout(now)
        forgot = self.scheduler.forget(now)
        if expired or gave_up or forgot:
            self.state.record_eval(now)

    def holds_end(self, now: float) -> bool:
        return self.scheduler.final_waiting(now)

    def end_pending(self) -> int:
        return self.scheduler.final_pending

    def counters(self) -> dict[str, int]:
        return self.scheduler.counters()

    def open_sink(self, run_dir: Path, start_time: float, simulation: bool, trackers: Trackers) -> None:
        """eval.jsonl and the run's trackers (TensorBoard's tb/eval), on the clock of buffer.jsonl (`start_time`)."""
        self.sink = MetricsSink(run_dir, "eval", start_time=start_time, simulation=simulation, trackers=trackers)

    def flush(self) -> None:
        """The rows of the results accepted since the last call, each at step = its policy_version."""
        if self.sink is not None:
            for version, row in self.scheduler.take_rows():
                self.sink.log(version, row)

    def close(self) -> None:
        self.flush()
        if self.sink is not None:
            self.sink.close()


class NoEvaluation(CoreExtension):
    """A buffer without evaluation (eval.sets empty): it refuses eval results, saying why; nothing else."""

    def __init__(self) -> None:
        self.handlers = {EvalResult: self._refuse}

    @staticmethod
    def _refuse(result: EvalResult, reply_to: Any, sender: str, now: float) -> list[tuple[Any, Any]]:
        raise RequestRejected("eval_off", "this buffer runs no evaluation (eval.sets is empty): send no eval_result")
