"""`tandem plot` (launch/plot.py) on synthetic run files: the PNG is written, and every bad input is refused with
one line that says what to change (exit 2), through the `tandem` entry point as a user calls it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir: Path, eval_rows: bool = True) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    steps = [{"step": s, "time": 2.0 * s, "reward/mean": 0.05 * s, "policy_version": s} for s in range(1, 21)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    if not eval_rows:
        return
    rows = []
    for version in (0, 10, 20):
        for label in ("arithmetic", "arithmetic-d2"):
            prefix = f"eval/{label}/"
            rows.append(
                {
                    "step": version,
                    "time": 2.0 * version + 1.0,
                    prefix + "strict_accuracy": version / 40,
                    prefix + "lenient_accuracy": version / 20,
                    prefix + "greedy/strict_accuracy": version / 30,
                    prefix + "pass@k": None,  # a null figure (undefined) is left out of the curve, not an error
                }
            )
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 30, "ti'  # a run still writing its next row
    (run_dir / "eval.jsonl").write_text(text)


def test_the_png_is_written_in_the_run_dir_or_where_out_says(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "run"
    _write_run(run_dir)
    assert main(["plot", str(run_dir)]) == 0
    default = run_dir / "eval.png"
    assert capsys.readouterr().out.strip() == str(default)
    assert default.read_bytes()[:8] == PNG_MAGIC and default.stat().st_size > 10_000  # a drawn figure, not a stub

    out = tmp_path / "figures" / "curves.png"
    assert main(["plot", str(run_dir), "--out", str(out), "--metrics", "greedy/strict_accuracy,pass@k"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("no run dir", "is not a directory"),
        ("no eval.jsonl", "did not evaluate during training (set eval.sets"),
        ("no metrics.jsonl", "metrics.jsonl does not exist"),
        ("no eval rows", "holds no eval rows"),
        ("unknown metric", "--metrics strict: no eval row holds it; the rows hold greedy/strict_accuracy"),
        ("empty metrics", "names no metric"),
    ],
)
def test_bad_input_is_refused_with_what_to_change(tmp_path: Path, capsys, case: str, says: str) -> None:
    run_dir = tmp_path / "run"
    metrics = "strict_accuracy"
    if case != "no run dir":
        _write_run(run_dir, eval_rows=case != "no eval.jsonl")
    if case == "no metrics.jsonl":
        (run_dir / "metrics.jsonl").unlink()
    if case == "no eval rows":
        (run_dir / "eval.jsonl").write_text(json.dumps({"step": 0, "time": 1.0}) + "\n")
    if case == "unknown metric":
        metrics = "strict"
    if case == "empty metrics":
        metrics = " , "
    assert main(["plot", str(run_dir), "--metrics", metrics]) == 2
    error = capsys.readouterr().err
    assert error.startswith("tandem plot: ") and says in error and len(error.strip().splitlines()) == 1
    assert not (run_dir / "eval.png").exists()
