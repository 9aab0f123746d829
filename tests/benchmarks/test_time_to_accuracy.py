"""benchmarks/time_to_accuracy's figures, from hand-made run directories (no process is started): the eval curve
on the publication clock, the automatic target, the better synchronous setup and the per-seed ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.common
from benchmarks import time_to_accuracy as tta

SET = "word_problems-d2"


def make_run(root: Path, name: str, accuracy: dict[int, float], published: dict[int, float]) -> None:
    """A finished run: config.json, 3 learner records (2 groups of 8 a step), eval rows, published.json."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"learner": {"groups_per_step": 2}, "algo": {"group_size": 8}}))
    records = [
        {
            "step": step,
            "time": 10.0 * step,
            "learner/samples_trained": 16 * step,
            "perf/wait_s": 3.0,
            "perf/train_s": 5.0,
            "perf/publish_s": 1.0,
            "perf/completion_tokens_min": 20,
            "perf/completion_tokens_max": 200,
            "staleness/mean": 0.0,
        }
        for step in (1, 2, 3)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = [
        {"step": v, "time": 0.0, f"eval/{SET}/strict_accuracy": a, f"eval/{SET}/strict_accuracy_stderr": 0.05}
        | {f"eval/{SET}/greedy/strict_accuracy": 1.0}  # greedy rows are not the measure
        for v, a in accuracy.items()
    ]
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / tta.PUBLISHED).write_text(json.dumps(published))


def test_ratio_against_the_better_synchronous_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    # every run starts at 0.1; peaks 0.5, 0.5, 0.4 (median 0.5): target = 0.1 + 0.5 x (0.5 - 0.1) = 0.3
    make_run(runs, "A-async-seed0", {0: 0.1, 4: 0.35, 8: 0.5}, {4: 100.0, 8: 180.0})
    make_run(runs, "A-sync-seed0", {0: 0.1, 4: 0.35, 8: 0.5}, {4: 160.0, 8: 300.0})
    make_run(runs, "A-sync-colocated-seed0", {0: 0.1, 4: 0.3, 8: 0.4}, {4: 90.0, 8: 150.0})
    make_run(runs, "not-a-run", {0: 0.1}, {})  # left out: not named <workload>-<setup>-seed<N>
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path / "results")
    assert tta.main(["--from-runs", str(runs), "--out", "tta"]) == 0
    result = json.loads((tmp_path / "results" / "tta.json").read_text())
    figures = result["workloads"]["A"]
    assert figures["target"] == pytest.approx(0.3)
    # colocated reaches 0.3 at version 4 (90 s), sync at version 4 (160 s): colocated is the better one
    assert figures["median_time_s"] == {"sync": 160.0, "sync-colocated": 90.0}
    assert figures["better_sync"] == "sync-colocated"
    assert figures["ratio"] == pytest.approx(100.0 / 90.0) and figures["seeds"] == 1
    assert figures["spread"] is None  # one seed: no spread, not 0
    # t_gen 3 s, t_train 5 + 1 s (steps 2 and 3): bound (3 + 6) / 6
    assert figures["overlap_bound"] == pytest.approx(1.5)
    (async_run,) = [run for run in result["runs"] if run["setup"] == "async"]
    assert [(p["version"], p["time_s"], p["samples_trained"]) for p in async_run["curve"]] == [
        (0, 0.0, 0),
        (4, 100.0, 64),
        (8, 180.0, 128),
    ]
    assert result["headline"] == tta.headline(result)
    assert result["headline"]["time_to_accuracy_ratio"] == {"A": pytest.approx(10 / 9)}
    assert (tmp_path / "results" / "tta.png").exists()


def test_a_run_that_never_reaches_the_target_gives_a_null_ratio_with_its_reason() -> None:
    curve = [{"version": 0, "time_s": 0.0, "accuracy": 0.1}, {"version": 4, "time_s": 50.0, "accuracy": 0.2}]
    never = {"workload": "C", "setup": "async", "seed": 0, "curve": curve, "t_gen_s": 1.0, "t_train_s": 1.0}
    sync = dict(never, setup="sync", curve=[*curve, {"version": 8, "time_s": 90.0, "accuracy": 0.5}])
    figures = tta.workload_figures([never, sync], target=0.4)
    assert figures["ratio"] is None and "async did not reach the target" in figures["ratio_why_null"]
    assert figures["time_to_target_s"] == {"async/seed0": None, "sync/seed0": 90.0}
    with pytest.raises(SystemExit, match="W=X"):
        tta._targets(["Z=0.5"])
