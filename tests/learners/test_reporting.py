"""The learner's step record and its rates (learners/reporting.py): the end-to-end rates over wall clock fall when
the wait for batches grows while the compute-only rate stays; computed from recorded times, no timing asserts."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from common.metrics import read_metrics
from common.types import Batch
from learners.checkpoint import LearnerState
from learners.learner import _buffer_counters, _count_consumed, _record
from learners.reporting import StepReporter, WallClockRates


class FakeClock:
    """A clock the test sets: `now` seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _step_stats(samples: int, tokens: int) -> dict[str, float]:
    """What a trainer's train_step returns, as far as the record's rates read it."""
    return {"perf/samples": samples, "perf/tokens": tokens, "perf/groups": 2, "reward/mean": 0.5, "staleness/mean": 0}


def test_wall_clock_rates_count_the_wait_and_the_session() -> None:
    rates = WallClockRates(start=10.0)
    first = rates.tick(12.0, samples=8, tokens=800)  # 2 s since the loop began (the first wait included)
    assert first["perf/interval_s"] == 2.0
    assert first["throughput/samples_per_s"] == 4.0 and first["throughput/tokens_per_s"] == 400.0
    second = rates.tick(16.0, samples=8, tokens=1200)  # 4 s since the previous step
    assert second["perf/interval_s"] == 4.0 and second["throughput/tokens_per_s"] == 300.0
    # the session: 16 samples and 2,000 tokens over the 6 s since start
    assert second["throughput/session_samples_per_s"] == pytest.approx(16 / 6)
    assert second["throughput/session_tokens_per_s"] == pytest.approx(2000 / 6)
    assert rates.tick(16.0, samples=0, tokens=0)["perf/interval_s"] == 1e-9  # no division by zero


def test_a_longer_wait_lowers_the_end_to_end_rate_and_not_the_compute_rate(tmp_path: Path) -> None:
    """A simulated learner: every step trains 8 samples of 1,000 tokens in 0.5 s, and the wait for the batch grows
    0.5 -> 1.5 -> 3.5 s (fewer generators feeding it). Its records, as the loop writes them."""
    clock = FakeClock()
    reporter = StepReporter(tmp_path, 3, 0, logging.getLogger("test.reporting"), clock=clock, simulation=True)
    state = LearnerState()
    for wait_s in (0.5, 1.5, 3.5):
        stats = _step_stats(8, 1000)
        _count_consumed(state, stats)
        timings = {"perf/wait_s": wait_s, "perf/train_s": 0.5, "perf/publish_s": 0.0, "perf/step_s": wait_s + 0.5}
        clock.now += wait_s + 0.5  # the wall time of the step: its wait, then its training
        reporter.report(state.step, _record(stats, timings, state, 0))
    reporter.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["perf/train_tokens_per_s"] for r in records] == [2000.0] * 3  # 1,000 tokens / 0.5 s, wait or not
    assert [r["perf/interval_s"] for r in records] == [1.0, 2.0, 4.0]
    assert [r["throughput/tokens_per_s"] for r in records] == [1000.0, 500.0, 250.0]
    assert [r["throughput/samples_per_s"] for r in records] == [8.0, 4.0, 2.0]
    # 24 samples over the session's 7 s; the ratio to the compute rate is the share of time spent training
    assert records[-1]["throughput/session_samples_per_s"] == pytest.approx(24 / 7)
    assert records[-1]["throughput/session_tokens_per_s"] / records[-1]["perf/train_tokens_per_s"] == pytest.approx(
        1.5 / 7
    )
    assert "perf/tokens_per_s" not in records[0]  # the compute-only rate is named for what it is
    assert all(r["simulation"] is True for r in records)


def test_the_log_line_shows_end_to_end_and_compute_rates(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    reporter = StepReporter(tmp_path, 1, 0, logging.getLogger("test.reporting"), clock=clock)
    clock.now = 2.0
    stats = _step_stats(8, 1000)
    timings = {"perf/wait_s": 1.5, "perf/train_s": 0.5, "perf/publish_s": 0.0, "perf/step_s": 2.0}
    with caplog.at_level(logging.INFO, logger="test.reporting"):
        reporter.report(1, _record(stats, timings, LearnerState(step=1), 0))
    reporter.close()
    assert "4.0 samples/s 500 tok/s (train 2,000 tok/s)" in caplog.text
    assert "simulation" not in read_metrics(tmp_path / "metrics.jsonl")[0]  # only a simulated run says SIMULATION


def test_the_record_carries_the_buffers_cumulative_counters_from_the_batch(tmp_path: Path) -> None:
    """The Batch's dropped_stale, dropped_no_signal and no_signal_reward_sum reach the step's record as they came
    (12 filtered samples of reward sum -4.6 here), the names benchmarks.time_to_reward reads."""
    batch = Batch(
        step=1, rank=0, groups=[], staleness=[], dropped_stale=4, dropped_no_signal=12, no_signal_reward_sum=-4.6
    )
    assert _buffer_counters(batch) == (4, 12, -4.6)
    stats = _step_stats(8, 1000)
    timings = {"perf/wait_s": 1.5, "perf/train_s": 0.5, "perf/publish_s": 0.0, "perf/step_s": 2.0}
    reporter = StepReporter(tmp_path, 1, 0, logging.getLogger("test.reporting"), clock=FakeClock())
    reporter.report(1, _record(stats, timings, LearnerState(step=1), *_buffer_counters(batch)))
    reporter.close()
    (record,) = read_metrics(tmp_path / "metrics.jsonl")
    assert record["buffer/dropped_stale"] == 4 and record["buffer/dropped_no_signal"] == 12
    assert record["buffer/no_signal_reward_sum"] == -4.6
