"""benchmarks/demo_wall.py without a demo: the figures from a run directory written by hand (metrics, eval rows, the
learner's dtype line), and the headline's keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.demo_wall import chosen_dtype, figures, headline, heldout


def _write(run_dir: Path, rewards: list[float], evals: list[tuple[int, float]], dtype_line: str) -> None:
    (run_dir / "logs").mkdir(parents=True)
    records = [{"step": i + 1, "time": 10.0 * (i + 1), "reward/mean": r} for i, r in enumerate(rewards)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = [{"step": v, "eval/arithmetic/greedy/strict_accuracy": a, "eval/arithmetic/prompts": 19} for v, a in evals]
    rows.append({"step": 12, "eval/arithmetic-d2/greedy/strict_accuracy": 0.9})  # another set: not held-out level 1
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "logs" / "learner-0.log").write_text(f"12:00:00 I [learner-0] tandem.dtype: {dtype_line}\n")


def test_figures_read_the_run(tmp_path: Path) -> None:
    _write(tmp_path, [0.2, 0.4, 0.6, 0.8, 1.0], [(12, 0.75), (0, 0.25), (6, 0.5)], "model.dtype auto -> float32: x")
    row = figures(321.0, tmp_path)
    assert row["wall_s"] == 321.0 and row["steps"] == 5 and row["first_step_s"] == 10.0
    assert row["reward_first_20pct"] == pytest.approx(0.2) and row["reward_last_20pct"] == pytest.approx(1.0)
    assert (row["heldout_strict_first"], row["heldout_strict_first_version"]) == (0.25, 0)
    assert (row["heldout_strict_last"], row["heldout_strict_last_version"]) == (0.75, 12)
    assert row["dtype"] == "float32"


def test_an_explicit_dtype_and_a_run_without_eval(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "learner-0.log").write_text("tandem.dtype: model.dtype bfloat16 (explicit): reason\n")
    assert chosen_dtype(tmp_path) == "bfloat16"
    with pytest.raises(RuntimeError, match="did the demo evaluate"):
        heldout([{"step": 0, "eval/arithmetic-d2/greedy/strict_accuracy": 0.5}])


def test_the_headline_holds_the_issues_keys() -> None:
    result = {
        "wall_s": 600.0,
        "cpu_flags": {"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": False},
        "dtype": "float32",
        "heldout_strict_first": 0.3,
        "heldout_strict_last": 0.7,
        "steps": 12,
        "gemm_gflops": 100.0,
    }
    assert headline(result) == {key: value for key, value in result.items() if key != "gemm_gflops"}
