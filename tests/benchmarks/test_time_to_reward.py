"""benchmarks.time_to_reward: the figures from hand-made metrics files (time to target, the overlap bound, the
fraction of it), from the kept demo runs (the issue's figures), and one tiny SIMULATION run of the grid runner."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest

import benchmarks.common
from benchmarks import time_to_reward as ttr
from benchmarks import time_to_reward_figures as figures
from common.metrics import read_metrics

KEPT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "kept_runs"


def write_run(path: Path, times: list[float], rewards: list[float], wait_s: float, extra: list[dict] | None = None):
    """A metrics.jsonl of len(times) steps, 32 samples each, train 5.5 s + publish 0.5 s after every wait_s."""
    rows = [
        {
            "step": i + 1,
            "time": t,
            "reward/mean": r,
            "perf/samples": 32,
            "learner/samples_trained": 32 * (i + 1),
            "perf/wait_s": wait_s,
            "perf/train_s": 5.5,
            "perf/publish_s": 0.5,
            **(extra[i] if extra else {}),
        }
        for i, (t, r) in enumerate(zip(times, rewards))
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


SYNC_TIMES = [10.0, 18.0, 26.0, 34.0, 42.0, 50.0]  # 8 s a step: wait 2 + train 5.5 + publish 0.5
ASYNC_TIMES = [12.0, 18.4, 24.8, 31.2, 37.6, 44.0]  # 6.4 s a step


def hand_made(folder: Path) -> Path:
    folder.mkdir()
    # trailing means from step 3: (0.25+0.5+0.75)/3 = 0.5, (0.5+0.75+1)/3 = 0.75, (0.75+1+1)/3 = 0.9167 >= 0.9
    write_run(folder / "eta0-seed0.metrics.jsonl", SYNC_TIMES, [0.25, 0.5, 0.75, 1.0, 1.0, 1.0], wait_s=2.0)
    # 0.5, 0.6667, 0.8333, 0.8333: never >= 0.9
    write_run(folder / "eta2-seed0.metrics.jsonl", ASYNC_TIMES, [0.5, 0.5, 0.5, 1.0, 1.0, 0.5], wait_s=0.0)
    # filtered: cumulative samples N (all-right groups, reward 1 each, so their sum S = N, but for step 6's
    # all-wrong group of 8). Trained 0.75 from step 2 on can never reach 0.9; counted back in, every arrived group:
    # 0.5; (0.75 x 32 + 32) / 64 = 0.875; (24 + 96) / 128 = 0.9375; 0.9375; 0.9375; (24 + 0) / 40 = 0.6
    filtered = [(0, 0), (32, 32), (128, 128), (224, 224), (320, 320), (328, 320)]
    extra = [{figures.FILTERED_SAMPLES_KEY: n, figures.FILTERED_REWARD_SUM_KEY: total} for n, total in filtered]
    write_run(folder / "eta2-ds-seed0.metrics.jsonl", ASYNC_TIMES, [0.5] + [0.75] * 5, 0.0, extra)
    (folder / "lora.metrics.jsonl").write_text("")  # no eta<N> in its name: left out
    return folder


def test_trailing_mean_and_time_to_target_by_hand(tmp_path: Path) -> None:
    assert figures.trailing_means([0.25, 0.5, 0.75, 1.0]) == [None, None, 0.5, 0.75]
    runs = {run["cell"]: run for run in ttr.load_runs(hand_made(tmp_path / "runs"), target=0.9)}
    assert set(runs) == {"eta0", "eta2", "eta2-ds"}
    sync, asynchronous, dynamic = runs["eta0"]["time_to_target"], runs["eta2"], runs["eta2-ds"]["time_to_target"]
    assert (sync["step"], sync["time_s"]) == (5, 42.0) and sync["trailing_mean_at_target"] == pytest.approx(2.75 / 3)
    assert not asynchronous["time_to_target"]["reached"] and asynchronous["time_to_target"]["time_s"] is None
    assert asynchronous["time_to_target"]["last_time_s"] == 44.0
    assert [p["reward"] for p in dynamic["curve"]] == pytest.approx([0.5, 0.875, 0.9375, 0.9375, 0.9375, 0.6])
    # trailing at step 3: (0.5 + 0.875 + 0.9375) / 3 = 0.771; step 4: (0.875 + 2 x 0.9375) / 3 = 0.9167 at 31.2 s
    assert (dynamic["step"], dynamic["time_s"], dynamic["reward_key"]) == (4, 31.2, figures.GENERATED_REWARD_KEY)
    # equality reaches it: (0.25 + 0.5 + 0.75) / 3 = 0.5 exactly at step 3
    assert figures.time_to_target(read_metrics(tmp_path / "runs" / "eta0-seed0.metrics.jsonl"), 0.5)["step"] == 3


def test_bound_and_fraction_by_hand(tmp_path: Path) -> None:
    runs = ttr.load_runs(hand_made(tmp_path / "runs"), target=0.9)
    sync = next(run for run in runs if run["cell"] == "eta0")
    # after step 1: t_gen = 2, t_train = 5.5 + 0.5 = 6; samples/s = 5 x 32 / (50 - 10) = 4.0
    assert (sync["t_gen_s"], sync["t_train_s"], sync["samples_per_s"]) == pytest.approx((2.0, 6.0, 4.0))
    (pair,) = figures.pairs(runs)["throughput"]
    # bound (2 + 6) / 6 = 4/3; async 5 x 32 / (44 - 12) = 5.0 samples/s, so 5 / 4 = 1.25 = 0.9375 of the bound
    assert pair["overlap_bound"] == pytest.approx(4 / 3)
    assert pair["achieved_ratio"] == pytest.approx(1.25)
    assert pair["fraction_of_bound"] == pytest.approx(0.9375)
    top = figures.headline(runs, 0.9)
    assert top["async_fraction_of_bound"] == pytest.approx(0.9375) and top["async_fraction_of_bound_met"]
    # eta2-ds at 31.2 s over eta0 at 42 s = 0.742857 <= 0.8
    assert top["time_to_reward_ratio"] == pytest.approx(31.2 / 42.0) and top["time_to_reward_ratio_met"]
    assert top["time_to_target_s"] == {"eta0/seed0": 42.0, "eta2/seed0": None, "eta2-ds/seed0": 31.2}
    with pytest.raises(ValueError, match="non-negative"):
        figures.overlap_bound(0.0, 0.0)


def test_a_filtered_run_without_the_filters_counters_gets_no_time(tmp_path: Path) -> None:
    path = write_run(tmp_path / "x.jsonl", SYNC_TIMES, [1.0] * 6, wait_s=2.0)  # reward/mean only: reached if read
    run = figures.run_figures(figures.RunKey(2, True, 0), "x", read_metrics(path), target=0.9)
    assert run["time_to_target"]["time_s"] is None and not run["time_to_target"]["reached"]
    assert figures.FILTERED_REWARD_SUM_KEY in run["time_to_target"]["why_null"]


def test_the_median_over_seeds_orders_unreached_runs() -> None:
    assert figures.median_of_seeds([0.7, math.inf, 0.6]) == (0.7, None)  # sorted 0.6, 0.7, inf
    assert figures.median_of_seeds([0.5, 0.7]) == (pytest.approx(0.6), None)
    assert figures.median_of_seeds([0.7, math.inf]) == (None, figures.ASYNC_NOT_REACHED)
    assert figures.median_of_seeds([0.0, 0.0, 0.9])[0] is None
    assert figures.median_of_seeds([]) == (None, "no pair of runs to compare")


def test_cells_from_names_and_configs(tmp_path: Path) -> None:
    assert ttr.key_of(Path("demo-eta2-async.metrics.jsonl")) == figures.RunKey(2, False, 0)  # the demo's seed
    assert ttr.key_of(Path("eta0-ds-seed3.metrics.jsonl")) == figures.RunKey(0, True, 3)
    assert ttr.key_of(Path("demo-lora.metrics.jsonl")) is None
    run_dir = tmp_path / "whatever"
    run_dir.mkdir()
    config = {"algo": {"max_staleness": 2}, "buffer": {"filter": "no_signal"}, "run": {"seed": 5}}
    (run_dir / "config.json").write_text(json.dumps(config))
    assert ttr.key_of(run_dir / "metrics.jsonl") == figures.RunKey(2, True, 5)


def saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> dict[str, Any]:
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path / "results")
    assert ttr.main([*argv, "--out", "ttr"]) == 0
    assert (tmp_path / "results" / "ttr.png").is_file()
    return json.loads((tmp_path / "results" / "ttr.json").read_text())


def test_the_kept_demo_runs_give_the_issues_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = saved(tmp_path, monkeypatch, ["--from-runs", str(KEPT)])
    runs = {run["cell"]: run["time_to_target"] for run in result["runs"]}
    assert (runs["eta0"]["step"], round(runs["eta0"]["time_s"])) == (15, 516)  # issue 17: step 15 after 516 s
    assert (runs["eta2"]["step"], round(runs["eta2"]["time_s"])) == (20, 610)  # step 20 after 610 s
    top = result["headline"]
    # 1.2986 / 1.1774 samples/s = 1.103, over (5.815 + 21.349) / 21.349 = 1.272: 0.867
    assert top["async_fraction_of_bound"] == pytest.approx(0.8668, abs=5e-4)
    assert top["time_to_reward_ratio"] is None and top["time_to_reward_ratio_why_null"].startswith("pending")


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_one_simulated_grid_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One `tandem run` of the SIMULATION config (random tokens: reward 0, so target 0 is reached at step 3)."""
    argv = ["--sim-step-s", "0.1", "--steps", "3", "--grid", "eta0", "--seeds", "0", "--target", "0"]
    result = saved(tmp_path, monkeypatch, [*argv, "--runs-dir", str(tmp_path / "runs")])
    (run,) = result["runs"]
    assert (run["cell"], run["steps"], run["time_to_target"]["step"]) == ("eta0", 3, 3)
    assert run["overrides"]["run.seed"] == 0 and (tmp_path / "runs" / "eta0-seed0" / "metrics.jsonl").is_file()
    assert result["headline"]["async_fraction_of_bound"] is None  # no eta2 run to pair with
    with pytest.raises(SystemExit, match="exists"):  # a second grid into the same folder would resume the runs
        ttr.main([*argv, "--runs-dir", str(tmp_path / "runs")])


def test_a_filtered_run_recorded_by_the_learner_is_counted_back_in(tmp_path: Path) -> None:
    """The records written as the learner writes them (`learners.learner._record` from a `Batch`, then its
    StepReporter), so the names the benchmark reads are the learner's own. 8 samples trained a step at reward/mean
    0.75 (can never reach 0.8); the buffer's cumulative (filtered samples, their reward sum): (0, 0), (8, 8.0) (two
    all-right groups of 4), (12, 12.0) (one more). Every generated sample: 0.75; (6 + 8) / 16 = 0.875;
    (6 + 4) / 12 = 0.8333. Trailing at step 3: (0.75 + 0.875 + 0.8333) / 3 = 0.8194 >= 0.8."""
    from common.types import Batch
    from learners.checkpoint import LearnerState
    from learners.learner import _buffer_counters, _record
    from learners.reporting import StepReporter

    run_dir = tmp_path / "runs" / "eta2-ds-seed0"
    clock = iter([0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0])
    reporter = StepReporter(run_dir, 3, 0, logging.getLogger("test.ttr"), clock=lambda: next(clock))
    timings = {"perf/wait_s": 0.0, "perf/train_s": 9.0, "perf/publish_s": 1.0, "perf/step_s": 10.0}
    stats = {"perf/samples": 8, "perf/tokens": 80, "perf/groups": 2, "reward/mean": 0.75, "staleness/mean": 0}
    for step, (filtered, reward_sum) in enumerate([(0, 0.0), (8, 8.0), (12, 12.0)], start=1):
        batch = Batch(step - 1, 0, [], [], 0, filtered, reward_sum)
        reporter.report(step, _record(stats, timings, LearnerState(step=step), *_buffer_counters(batch)))
    reporter.close()
    (run,) = ttr.load_runs(tmp_path / "runs", target=0.8)
    reached = run["time_to_target"]
    assert (run["cell"], reached["reward_key"], reached["step"]) == ("eta2-ds", figures.GENERATED_REWARD_KEY, 3)
    assert [p["reward"] for p in reached["curve"]] == pytest.approx([0.75, 0.875, 10 / 12])
    assert reached["trailing_mean_at_target"] == pytest.approx((0.75 + 0.875 + 10 / 12) / 3)
