"""benchmarks/eval_overhead.py without processes: its headline from hand-made run figures, its configs load, and the
saved result's headline is what `headline()` makes of the rest of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import eval_overhead
from common.config import load_config

SAVED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "eval_overhead.json"


def _run(eval_on: bool, steps_per_s: float, rows: int = 0, leases: int = 0, holds: bool = True) -> dict:
    return {
        "eval": eval_on,
        "steps_per_s": steps_per_s,
        "eval_rows": rows,
        "eval_leases_issued": leases,
        "eval_identity_holds": holds,
    }


def test_the_headline_compares_the_mean_rates_on_and_off() -> None:
    runs = [_run(False, 2.0), _run(True, 1.5, 14, 16), _run(False, 1.0), _run(True, 1.5, 12, 12)]
    figures = eval_overhead.headline({"runs": runs, "step_s": 0.5})
    # off: mean 1.5, spread (2 - 1) / 1.5; on: mean 1.5, spread 0; all exact in binary but the thirds
    assert figures["step_rate_ratio"] == 1.0 and figures["steps_per_s_off"] == figures["steps_per_s_on"] == 1.5
    assert figures["off_spread"] == pytest.approx(2 / 3) and figures["on_spread"] == 0.0
    assert figures["ideal_steps_per_s"] == 2.0 and figures["repeats"] == 2
    assert figures["eval_rows_per_on_run"] == 13.0 and figures["eval_leases_per_on_run"] == 14.0
    assert figures["eval_identity_holds"] is True
    runs[1]["eval_identity_holds"] = False
    assert eval_overhead.headline({"runs": runs, "step_s": 0.5})["eval_identity_holds"] is False


def test_the_two_configs_differ_only_in_eval(tmp_path: Path) -> None:
    overrides = eval_overhead.sim_overrides(0.5, 24)
    (tmp_path / "off.toml").write_text(eval_overhead.BASE_CONFIG)
    (tmp_path / "on.toml").write_text(eval_overhead.BASE_CONFIG + eval_overhead.EVAL_SECTION)
    off, on = (load_config(tmp_path / name, overrides) for name in ("off.toml", "on.toml"))
    assert not off.eval.enabled and on.eval.sets == list(eval_overhead.EVAL_SETS)
    assert off.model_dump(exclude={"eval"}) == on.model_dump(exclude={"eval"}) and off.run.simulate
    # the headroom the benchmark relies on: a training batch's engine round is 16% of a learner step
    round_s = on.generator.sim_tokens * on.generator.sim_token_s
    step_s = on.learner.groups_per_step * on.algo.group_size * on.learner.sim_sample_s
    assert round_s / step_s == pytest.approx(0.16)


def test_the_saved_headline_is_made_from_the_saved_runs() -> None:
    result = json.loads(SAVED.read_text())
    assert eval_overhead.headline(result) == result["headline"]
