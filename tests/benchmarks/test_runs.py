"""The benchmarks' shared helpers (benchmarks.runs, benchmarks.run_all) and pure parts of fleet_scaling: no processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.run_all import format_figures, headline
from benchmarks.runs import RunOutcome, kept_runs, process_cpu_s, trained_rate
from common.config import parse_overrides
from launch.testing import override_args


def test_override_args_parse_back_as_the_same_values() -> None:
    overrides = {
        "algo.max_staleness": 0,
        "generator.cpu_cores": "1",
        "learner.sim_sample_s": 0.03125,
        "run.simulate": True,
        "run.name": "sim-eta0",
    }
    assert parse_overrides(override_args(overrides)) == overrides


def records(times: list[float], per_step: int = 32) -> list[dict]:
    return [{"step": i + 1, "time": t, "learner/samples_trained": per_step * (i + 1)} for i, t in enumerate(times)]


def test_trained_rate_uses_the_window_after_first_step() -> None:
    rate = trained_rate(records([5.0, 7.0, 8.0, 9.0, 10.0]), first_step=2)  # step 1 waited for the first batch
    assert rate["samples_per_s"] == pytest.approx(3 * 32 / 3.0)
    assert rate["window_steps"] == 3 and rate["step_s"] == pytest.approx(1.0)


def test_trained_rate_says_what_to_change_when_the_run_is_too_short() -> None:
    with pytest.raises(ValueError, match="total_steps"):
        trained_rate(records([1.0, 2.0]), first_step=2)


def test_cpu_between_counts_only_the_window_and_the_named_roles() -> None:
    outcome = RunOutcome(
        name="x",
        run_dir=Path("."),
        wall_s=0.0,
        records=[],
        buffer_records=[],
        step_wall={1: 10.0, 2: 11.0},
        generators_ready_wall=10.5,
        load_avg=0.0,
        cpu_samples=[
            (10.0, {"buffer-0": 1.0, "generator-0": 0.5}),
            (11.0, {"buffer-0": 1.25, "generator-0": 0.75, "generator-1": 0.5}),
            (12.0, {"buffer-0": 2.0}),
        ],  # generator-0 exited after 11.0
    )
    assert outcome.cpu_between("buffer", 10.0, 11.5) == pytest.approx(0.25)
    assert outcome.cpu_between("generator", 10.0, 12.0) == pytest.approx(0.75)  # 1.25 - 0.5
    assert outcome.first_step_after(10.5) == 2


def test_process_cpu_s_reads_this_process_and_none_for_a_dead_one() -> None:
    spent = process_cpu_s(os.getpid())
    assert spent is not None and spent > 0
    assert process_cpu_s(2**22 + 1) is None  # above pid_max's default


def test_headline_prefers_the_benchmarks_own_then_top_level_numbers() -> None:
    assert headline({"headline": {"ratio": 2.0}, "x": 1}) == {"ratio": 2.0}
    assert headline({"x": 1, "ok": True, "table": {"a": 1.5}, "mixed": {"a": "b"}, "rows": [1]}) == {
        "x": 1,
        "table": {"a": 1.5},
    }
    assert format_figures({"ratio": 2.04567, "t": {"a": 1}}) == "ratio 2.05  t.a 1"


def test_scaling_efficiency_is_against_the_measured_capacities() -> None:
    from benchmarks.fleet_scaling import add_scaling_efficiency

    calibration = {"one_generator": {"measured": 30.0}, "learner_world_size_1": {"measured": 75.0}}
    rows = [
        {"generators": 2, "world_size": 1, "samples_per_s": 57.0, "training_capacity": 80.0},  # generation-bound
        {"generators": 8, "world_size": 1, "samples_per_s": 72.0, "training_capacity": 80.0},  # training-bound
        {"generators": 8, "world_size": 2, "samples_per_s": 150.0, "training_capacity": 160.0},  # not calibrated
    ]
    add_scaling_efficiency(rows, calibration)
    assert [row["scaling_efficiency"] for row in rows] == pytest.approx([57 / 60, 72 / 75, 150 / 160])


def test_kept_runs_are_the_saved_ones_not_redone_and_comparable(tmp_path: Path) -> None:
    saved = tmp_path / "grid.json"
    assert kept_runs(saved, [], ("seed",)) == []  # nothing saved yet
    old = [
        {"workload": "C", "seed": 0, "steps": 16},
        {"workload": "B", "seed": 0, "steps": 16},  # redone below: replaced
        {"workload": "B", "seed": 1, "steps": 24},  # trained another number of steps: not comparable
        {"seed": 2, "steps": 16},  # a former version of the benchmark: no workload field
    ]
    saved.write_text(json.dumps({"runs": old}))
    new = [{"workload": "B", "seed": 0, "steps": 16}]
    assert kept_runs(saved, new, ("workload", "seed")) == old[:1] + old[2:3]
    assert kept_runs(saved, new, ("workload", "seed"), same=("steps",)) == old[:1]
