"""The learner's wait for the buffer's end (rank 0, after its last step; with eval.at_end the end waits for the
final evaluation round): the buffer's `end_pending` read over a real socket from a buffer core that evaluates, and
the wait's four ends: the work is done, the buffer stops answering, the time passes, a signal came."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import pytest

from buffers.core import BufferCore, RequestRejected
from buffers.evaluation import EvalScheduler
from buffers.state import BufferState
from common.config import EvalConfig
from common.eval_messages import EvalGrant, EvalResult
from common.sockets import Server, SocketSecurity
from common.types import LeaseRequest
from launch.testing import ServerThread, free_port
from learners import learner
from learners.buffer_link import BufferLink
from tests.buffers.fakes import fake_prompts, make_settings

log = logging.getLogger("test")


class EvalCoreServer(ServerThread):
    """A buffer core evaluating one set of 2 prompts (greedy only), behind a real socket."""

    name = "eval-core-buffer"

    def __init__(self, port: int, evaluate: bool = True) -> None:
        super().__init__(port)
        config = EvalConfig(sets=["arithmetic"], greedy=True, samples=0)
        evaluation = EvalScheduler(config, {"arithmetic": fake_prompts(2)}, max_tokens=8, lease_timeout_s=30.0)
        evaluation = evaluation if evaluate else None
        self.core = BufferCore(BufferState(make_settings(), fake_prompts(8), None, evaluation))
        self.start()

    def answer(self, server: Server, request: Any) -> list[tuple[Any, Any, list[Any]]]:
        try:
            replies = self.core.handle(request.message, request, request.sender, time.time(), role=request.role)
        except RequestRejected as refusal:
            server.reject(request, refusal.reason, refusal.kind)
            return []
        return [(reply_to, reply, []) for reply_to, reply in replies]

    def evaluate(self) -> None:
        """A generator takes the final round's lease and answers it."""
        with self.lock:
            ((_, grant),) = self.core.handle(LeaseRequest(0, 2, 0), None, "generator", time.time())
            assert isinstance(grant, EvalGrant)
            ones = np.ones(2, np.int8)
            result = EvalResult(
                0,
                grant.lease_id,
                0,
                [0, 1],
                np.ones(2, np.float32),
                np.ones(2, np.int32),
                np.zeros(2, np.uint8),
                ones,
                ones,
                ones,
            )
            ((_, ack),) = self.core.handle(result, None, "generator", time.time())
            assert ack.status == "accepted"


def test_the_link_reads_the_final_rounds_pending_sets_and_none_once_the_buffer_is_gone() -> None:
    port = free_port()
    buffer = EvalCoreServer(port)
    link = BufferLink(f"127.0.0.1:{port}", SocketSecurity(), 0, 1, num_groups=2, hold_s=0.1, reply_margin_s=0.3)
    try:
        assert link.end_pending() == 0  # no final report yet
        link.report_version(0, 0, resync=True, final=True)
        assert link.end_pending() == 1
        buffer.evaluate()
        assert link.end_pending() == 0
        buffer.stop()
        assert link.end_pending(timeout_s=0.3) is None
        assert link.counters["stats_unanswered"] == 1
    finally:
        link.close()
        buffer.stop()


class FakeLink:
    """Answers `end_pending` from a script (its last value repeats)."""

    def __init__(self, *answers: int | None) -> None:
        self.answers, self.calls = list(answers), 0

    def end_pending(self) -> int | None:
        self.calls += 1
        return self.answers[min(self.calls, len(self.answers)) - 1]


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(learner, "END_POLL_S", 0.01)


def test_the_wait_ends_when_the_round_is_done() -> None:
    link = FakeLink(2, 1, 0, 5)
    learner._wait_for_run_end(link, 60.0, lambda: False, log)
    assert link.calls == 3


def test_the_wait_ends_when_the_buffer_stops_answering() -> None:
    link = FakeLink(1, None, 1)
    learner._wait_for_run_end(link, 60.0, lambda: False, log)
    assert link.calls == 2


def test_the_wait_ends_after_the_timeout_or_on_a_signal(caplog: pytest.LogCaptureFixture) -> None:
    link = FakeLink(2)
    with caplog.at_level(logging.WARNING):
        learner._wait_for_run_end(link, 0.05, lambda: False, log)
    assert link.calls >= 2 and "still waits for 2 pieces of work, 0s passed" in caplog.text
    link = FakeLink(2)
    learner._wait_for_run_end(link, 60.0, lambda: True, log)
    assert link.calls == 1


def test_a_buffer_that_does_not_evaluate_answers_zero() -> None:
    """A learner whose config evaluates does not wait on a buffer that does not (no extension holds its end)."""
    port = free_port()
    buffer = EvalCoreServer(port, evaluate=False)
    link = BufferLink(f"127.0.0.1:{port}", SocketSecurity(), 0, 1, num_groups=2, hold_s=0.1, reply_margin_s=0.3)
    try:
        link.report_version(0, 0, resync=True, final=True)
        assert link.end_pending() == 0
        assert buffer.core.run_over(time.time())
    finally:
        link.close()
        buffer.stop()
