"""The console of `tandem run` (launch/progress.py): the progress bar's line of a learner record."""

from __future__ import annotations

from launch.progress import _status


def test_the_bar_shows_end_to_end_rates_and_the_compute_rate() -> None:
    record = {
        "reward/mean": 0.25,
        "staleness/mean": 0.5,
        "staleness/max": 1,
        "throughput/samples_per_s": 12.34,
        "throughput/tokens_per_s": 4321.0,
        "perf/train_tokens_per_s": 43210.0,
    }
    status = _status(record)
    assert "12.3 samples/s 4,321 tok/s (train 43,210 tok/s)" in status and "SIMULATION" not in status
    assert _status({**record, "simulation": True}).startswith("SIMULATION")
    assert "- samples/s" in _status({"reward/mean": 0.25})  # a record without them (an older run) shows '-'
