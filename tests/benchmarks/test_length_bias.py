"""benchmarks/length_bias.py at the smoke size (2 regimes x 3 modes x 20 steps, about a second): its JSON has the
documented keys, η holds in every run, and in the regime where every group can arrive within η, fifo trains shorter
completions than it generated while oldest_first drops none (the simulation is deterministic: these are exact
outcomes of one seeded run, not timings). The saved result's headline is what its regimes say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.common
from benchmarks import length_bias

SAVED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "length_bias.json"


def test_the_smoke_run_writes_its_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    assert length_bias.main(["--steps", "20", "--seeds", "0"]) == 0
    result = json.loads((tmp_path / "length_bias.json").read_text())
    assert {"benchmark", "machine", "headline", "regimes", "model", "steps", "seeds"} <= result.keys()
    assert set(result["regimes"]) == set(length_bias.REGIMES)
    for regime in result["regimes"].values():
        assert set(regime["modes"]) == set(length_bias.MODES)
        for figures in regime["modes"].values():
            for run in figures["runs"]:
                assert run["metrics"]["buffer/staleness_max"] <= length_bias.ETA
                assert run["metrics"]["buffer/learner_version"] == 20
    fits = result["headline"]["fits"]
    assert fits["fifo"]["len_trained_mean"] < fits["fifo"]["len_generated_mean"]
    assert fits["fifo"]["drop_rate_longest"] > fits["fifo"]["drop_rate_shortest"] == 0.0
    assert fits["oldest_first"]["dropped_share"] == 0.0
    assert result["headline"] == length_bias.headline(result)


def test_the_saved_headline_is_made_from_the_saved_regimes() -> None:
    result = json.loads(SAVED.read_text())
    assert result["headline"] == length_bias.headline(result)
    fits = result["headline"]["fits"]
    assert fits["oldest_first"]["drop_rate_longest"] < fits["fifo"]["drop_rate_longest"]
