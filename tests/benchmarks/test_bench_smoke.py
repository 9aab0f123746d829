"""The pipeline benchmark runs end to end: the SIMULATION part of async_vs_sync with tiny settings, through real
`tandem run` processes on free ports, writes its JSON (and plot) with the documented keys.

Not a timing test: the only figure checked is that overlapping generation and training (η = 2) trains faster
than alternating them (η = 0), ratio > 1, which holds whatever the machine's load (the ideal is 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.common
from benchmarks import async_vs_sync

RUN_KEYS = {
    "eta",
    "samples_per_s",
    "step_s",
    "ideal_step_s",
    "efficiency",
    "wait_s",
    "train_s",
    "publish_s",
    "staleness_max",
    "curve",
}


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_async_vs_sync_simulation_writes_its_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path / "results")
    code = async_vs_sync.main(
        ["--part", "sim", "--step-s", "0.3", "--steps", "6", "--weights-mb", "1", "--runs-dir", str(tmp_path / "runs")]
    )
    assert code == 0
    result = json.loads((tmp_path / "results" / "async_vs_sync.json").read_text())
    assert (tmp_path / "results" / "async_vs_sync.png").is_file()
    assert {"benchmark", "machine", "headline", "simulation", "real"} <= result.keys()
    assert result["real"] is None  # --part sim
    sim = result["simulation"]
    assert {"ratio", "theoretical_ratio", "target_ratio", "runs", "gen_batch_s", "train_batch_s"} <= sim.keys()
    assert set(sim["runs"]) == {"eta0", "eta2"}
    for run in sim["runs"].values():
        assert RUN_KEYS <= run.keys(), RUN_KEYS - run.keys()
        assert run["steps"] == 6 and [p["step"] for p in run["curve"]] == list(range(1, 7))
        assert run["staleness_max"] <= run["eta"]
    assert sim["ratio"] == pytest.approx(sim["runs"]["eta2"]["samples_per_s"] / sim["runs"]["eta0"]["samples_per_s"])
    assert result["headline"]["sim_ratio"] == sim["ratio"]
    assert sim["ratio"] > 1.0, f"async did not train faster than sync: {sim['ratio']:.2f}x"


def test_demo_runs_judges_the_kept_runs_and_a_flat_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import demo_runs

    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path / "results")
    assert demo_runs.main([]) == 0  # the kept demo runs (η = 2, η = 0, LoRA at η = 2) meet the criterion
    result = json.loads((tmp_path / "results" / "demo_runs.json").read_text())
    assert result["headline"]["all_learned"] and len(result["runs"]) == 3
    assert [run["staleness_max"] for run in result["runs"]] == [2, 0, 2]

    flat = tmp_path / "flat.jsonl"
    flat.write_text(
        "".join(
            json.dumps({"step": step, "time": 10.0 * step, "reward/mean": 0.5, "learner/samples_trained": 32 * step})
            + "\n"
            for step in range(1, 11)
        )
    )
    assert demo_runs.main(["--run", f"flat={flat}"]) == 1
    run = json.loads((tmp_path / "results" / "demo_runs.json").read_text())["runs"][0]
    assert run["rise"] == 0 and not run["learned"] and run["samples_per_s"] == pytest.approx(3.2)
    with pytest.raises(SystemExit):
        demo_runs.main(["--run", "no-equals-sign"])
