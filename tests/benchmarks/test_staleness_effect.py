"""benchmarks/staleness_effect's figures from hand-made run directories (no process is started): end accuracy per
run, the per-cell mean and standard error over seeds, the best correction over η > 0 and η = 4's gap."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import benchmarks.common
from benchmarks import staleness_effect as se

SET = "word_problems-d2"


def make_run(root: Path, name: str, accuracy: dict[int, float]) -> None:
    run = root / name
    run.mkdir(parents=True)
    records = [
        {"step": s, "time": 5.0 * s, "learner/samples_trained": 16 * s, "staleness/mean": 0.5, "reward/mean": 0.3}
        for s in (1, 2, 3)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = [
        {"step": v, f"eval/{SET}/strict_accuracy": a, f"eval/{SET}/strict_accuracy_stderr": 0.04 + v / 1000}
        for v, a in accuracy.items()
    ]
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_cells_best_correction_and_the_eta4_gap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    # end accuracy = the mean of the last two evaluations (versions 8 and 12)
    make_run(runs, "eta0-tis-seed0", {0: 0.1, 4: 0.2, 8: 0.4, 12: 0.5})  # 0.45
    make_run(runs, "eta0-tis-seed1", {0: 0.1, 4: 0.2, 8: 0.5, 12: 0.6})  # 0.55
    make_run(runs, "eta4-tis-seed0", {0: 0.1, 4: 0.2, 8: 0.3, 12: 0.4})  # 0.35
    make_run(runs, "eta4-tis-seed1", {0: 0.1, 4: 0.2, 8: 0.4, 12: 0.5})  # 0.45
    make_run(runs, "eta4-none-seed0", {0: 0.1, 4: 0.1, 8: 0.2, 12: 0.2})  # 0.20: one seed, its eval stderr
    make_run(runs, "eta2-tis-seed0", {0: 0.1, 4: 0.2, 8: 0.3, 12: 0.3})  # 0.30
    make_run(runs, "eta2-tis-seed1", {0: 0.1, 4: 0.2, 8: 0.3, 12: 0.32})  # 0.31: two seeds closer than their evals
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path / "results")
    assert se.main(["--from-runs", str(runs), "--out", "se"]) == 0
    result = json.loads((tmp_path / "results" / "se.json").read_text())
    cells = result["cells"]
    assert cells["eta0_tis"]["end_accuracy"] == pytest.approx(0.5)
    # two seeds 0.45 and 0.55: stdev 0.0707, / sqrt(2) = 0.05
    assert cells["eta0_tis"]["stderr"] == pytest.approx(0.05)
    assert cells["eta4_tis"]["end_accuracy"] == pytest.approx(0.4) and cells["eta4_tis"]["stderr"] == pytest.approx(
        0.05
    )
    assert cells["eta4_none"]["stderr"] == pytest.approx(0.052)  # the larger end eval stderr (version 12)
    # seed variance 0.01**2 / 2 = 5e-5 is below each run's eval variance 0.052**2: the floor, sqrt(0.052**2 / 2)
    assert cells["eta2_tis"]["stderr"] == pytest.approx(0.052 / math.sqrt(2))
    top = result["headline"]
    assert top == se.headline(result)
    assert top["best_correction"] == "tis"  # 0.40 against none's 0.20 over η > 0
    assert top["eta4_gap_stderr"] == pytest.approx((0.4 - 0.5) / math.sqrt(0.05**2 + 0.05**2))
    assert top["why_null"] is None
    assert (tmp_path / "results" / "se.png").exists()


def test_a_missing_eta0_cell_gives_a_null_gap_with_its_reason() -> None:
    cells = {"eta4_tis": {"eta": 4, "correction": "tis", "end_accuracy": 0.4, "stderr": 0.05, "samples_per_s": 1.0}}
    top = se.headline({"cells": cells})
    assert top["best_correction"] == "tis" and top["eta4_gap_stderr"] is None
    assert "eta0_tis" in top["why_null"]
