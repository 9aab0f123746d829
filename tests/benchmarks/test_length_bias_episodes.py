"""benchmarks/length_bias_episodes.py at the smoke size (3 regimes x 3 modes x 20 steps, about two seconds): its JSON
has the documented keys, η holds in every run, oldest_first drops no episode where every one can arrive within η,
and where the longest take more than η steps every order drops them (the simulation is deterministic: exact
outcomes of one seeded run, not timings). The groups it builds are the episode driver's layout, whose turns the
buffer counts from the loss mask. The saved result's headline is what its regimes say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.common
from benchmarks import length_bias_episodes as bench
from buffers.lengths import sample_lengths, sample_turns
from common.types import PromptItem

SAVED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "length_bias_episodes.json"


def test_the_smoke_run_writes_its_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path)
    assert bench.main(["--steps", "20", "--seeds", "0"]) == 0
    result = json.loads((tmp_path / "length_bias_episodes.json").read_text())
    assert {"benchmark", "machine", "headline", "regimes", "model", "steps", "seeds"} <= result.keys()
    assert set(result["regimes"]) == set(bench.REGIMES)
    for regime in result["regimes"].values():
        assert set(regime["modes"]) == set(bench.MODES)
        for figures in regime["modes"].values():
            assert set(figures["by_turns"]) == {"le_1", "le_2", "le_4", "le_8", "gt_8"}  # halvings of max_turns 8
            for run in figures["runs"]:
                assert run["metrics"]["buffer/staleness_max"] <= bench.ETA
                assert run["metrics"]["buffer/learner_version"] == 20
    headline = result["headline"]
    assert headline["fits"]["oldest_first"]["dropped_share"] == 0.0
    assert all(headline["late"][mode]["turns_drop_rate_longest"] > 0 for mode in bench.MODES)
    assert headline == bench.headline(result)


def test_the_groups_count_the_turns_their_episodes_took() -> None:
    sim = bench.EpisodeSimulation("fifo", seed=0, steps=10, regime=bench.REGIMES["fits"])
    prompt = PromptItem(3, 0, [], {})
    episodes = [sim.timed_turns(turns) for turns in bench.episode_turns(0, prompt)]
    group = sim.arrival((1, 0, prompt, 0.0, episodes))
    group.validate()
    assert sample_turns(group).tolist() == [len(turns) for turns, _ in episodes]
    assert sample_lengths(group).tolist() == [sum(turns) for turns, _ in episodes]  # environment tokens are masked
    assert group.finish_reasons == ["max_turns" if len(t) == bench.MAX_TURNS else "done" for t, _ in episodes]


def test_the_saved_headline_is_made_from_the_saved_regimes() -> None:
    result = json.loads(SAVED.read_text())
    assert result["headline"] == bench.headline(result)
    near = result["headline"]["near"]
    assert near["oldest_first"]["len_drop_rate_longest"] < near["fifo"]["len_drop_rate_longest"]
