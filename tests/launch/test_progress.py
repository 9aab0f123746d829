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


def test_the_summary_shows_each_reward_component_and_the_reward_model_fallbacks(tmp_path) -> None:
    import json

    from launch.progress import summarize

    steps = [
        {"step": s, "reward/mean": 0.1 * s, "reward/correct": 0.0 if s < 3 else 0.5, "reward/reward_model": s}
        for s in range(1, 6)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    for index, fallbacks in ((0, 2), (1, 1)):
        record = {"step": 5, "actor/reward_model_fallbacks": fallbacks}
        (tmp_path / f"generator-{index}.jsonl").write_text(json.dumps(record) + "\n")
    text = summarize(tmp_path, wall_s=60.0)
    assert "reward/correct  first 20% of steps 0.000  ->  last 20% 0.500" in text  # the verifier beside the RM
    assert "reward/reward_model  first 20% of steps 1.000  ->  last 20% 5.000" in text
    assert "reward model fallbacks 3 groups" in text
    (tmp_path / "generator-0.jsonl").unlink()
    (tmp_path / "generator-1.jsonl").write_text(json.dumps({"step": 5}) + "\n")  # no reward model: no such line
    assert "fallbacks" not in summarize(tmp_path, wall_s=60.0)
