"""benchmarks/slow_generators.py without processes: its grid, a point's figures from a buffer record (discarded =
refused + duplicate samples, of those generated), and the headline from hand-made points."""

from __future__ import annotations

import pytest

from benchmarks import slow_generators
from benchmarks.slow_generators import GROUP_SIZE, TIMEOUT_S, figures, grid, headline


def test_the_grid_spans_the_issues_ranges() -> None:
    points = grid(quick=False)
    samples = [p["sample_s"] / TIMEOUT_S for p in points if p["sweep"] == "sample"]
    steps = [p["step_s"] / TIMEOUT_S for p in points if p["sweep"] == "step"]
    assert min(samples) == 0.1 and max(samples) == 10.0  # x lease_timeout_s
    assert max(steps) == 3.0  # x heartbeat_timeout_s
    for point in points:  # tokens x step time is the sample time, to within one step
        assert abs(point["tokens"] * point["step_s"] - point["sample_s"]) <= point["step_s"] / 2
        assert point["run_s"] >= slow_generators.SAMPLES_PER_RUN * point["sample_s"]


def test_discarded_counts_refused_and_duplicate_samples() -> None:
    point = {"sweep": "sample", "factor": 5.0, "step_s": 0.2, "sample_s": 20.0, "tokens": 100, "run_s": 100.0}
    last = {"buffer/arrived": 64, "buffer/rejected": 48, "buffer/duplicates": 2, "buffer/dropped_stale": 4}
    row = figures(point, last, [{"step": 1}, {"step": 2}], wall_s=3600.0)
    generated = 64 + 2 * GROUP_SIZE  # arrived, and the duplicates the buffer did not count as arrived
    assert row["samples_generated"] == generated and row["samples_discarded"] == 48 + 2 * GROUP_SIZE
    assert row["discarded_share"] == pytest.approx((48 + 8) / generated)
    assert row["dropped_stale_share"] == pytest.approx(4 / generated) and row["steps_per_hour"] == 2.0
    empty = figures(point, {}, [], wall_s=10.0)
    assert empty["discarded_share"] == 0.0 and empty["steps"] == 0


def test_the_headline_is_the_worst_point_of_each_code() -> None:
    now = [{"discarded_share": 0.0, "steps_per_hour": 300.0}, {"discarded_share": 0.0, "steps_per_hour": 90.0}]
    before = [{"discarded_share": 0.0, "steps_per_hour": 300.0}, {"discarded_share": 1.0, "steps_per_hour": 0.0}]
    assert headline({"points": now, "points_before": before}) == {
        "discarded_share_live_max": 0.0,
        "discarded_share_live_max_before": 1.0,
        "steps_per_hour_min": 90.0,
        "steps_per_hour_min_before": 0.0,
    }
    assert headline({"points": now, "points_before": []})["discarded_share_live_max_before"] is None
