"""The eval side of `tandem run`'s console (launch/progress.py): the eval line of the live display, fed by
eval.jsonl as it grows, and the summary's eval figures first vs last, on synthetic eval rows (the buffer's
format: one record per (set, version), `step` = policy version, `eval/<label>/<metric>`)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from rich.console import Console

from launch.progress import RunProgress, eval_line, eval_points, summarize


def _row(label: str, version: int, strict: float, lenient: float, **extra: Any) -> dict[str, Any]:
    metrics = {
        "strict_accuracy": strict,
        "lenient_accuracy": lenient,
        "pass@1": strict,
        "pass@k": min(1.0, 2 * strict),
        "k": 4,
        "greedy/strict_accuracy": strict / 2,
        "greedy/lenient_accuracy": lenient / 2,
        **extra,
    }
    return {"step": version, "time": 1.5 * version, **{f"eval/{label}/{key}": value for key, value in metrics.items()}}


def _append(path: Path, *records: dict[str, Any], torn: str = "") -> None:
    with path.open("a") as handle:
        handle.write("".join(json.dumps(record) + "\n" for record in records) + torn)


def _rendered(progress: RunProgress) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(progress.progress.get_renderable())
    return console.file.getvalue()


def test_the_eval_line_follows_eval_jsonl_with_the_newest_version_per_set(tmp_path: Path) -> None:
    _append(tmp_path / "metrics.jsonl", {"step": 1, "reward/mean": 0.2})
    progress = RunProgress(tmp_path / "metrics.jsonl", total_steps=30)
    progress.refresh()
    assert progress.progress.eval_line == "" and "eval" not in _rendered(progress)  # no eval.jsonl: no eval line

    evals = tmp_path / "eval.jsonl"
    torn = json.dumps(_row("arithmetic", 20, 0.9, 0.9))[:40]  # the buffer is mid-write of v20's row
    _append(evals, _row("arithmetic", 0, 0.0, 0.25), _row("arithmetic-d2", 0, 0.125, 0.5), torn=torn)
    progress.refresh()
    assert progress.progress.eval_line == (
        "eval v0  arithmetic strict 0.00 lenient 0.25 pass@4 0.00 | arithmetic-d2 strict 0.12 lenient 0.50 pass@4 0.25"
    )
    with evals.open("a") as handle:  # the rest of the torn line, then a later row of one set only
        handle.write(json.dumps(_row("arithmetic", 20, 0.9, 0.9))[40:] + "\n")
    progress.refresh()
    line = progress.progress.eval_line
    assert line.startswith("eval  arithmetic v20 strict 0.90 lenient 0.90 pass@4 1.00 | arithmetic-d2 v0 "), line
    assert line in _rendered(progress)

    _append(evals, _row("arithmetic", 10, 0.5, 0.5))  # an older version arriving late does not replace v20
    progress.refresh()
    assert "arithmetic v20" in progress.progress.eval_line


def test_a_greedy_only_set_shows_its_greedy_figures() -> None:
    record = {"step": 4, "eval/arithmetic/greedy/strict_accuracy": 0.25, "eval/arithmetic/greedy/lenient_accuracy": 1}
    assert eval_line(eval_points([record])) == "eval v4  arithmetic greedy strict 0.25 lenient 1.00"


def test_eval_points_split_keys_by_set_and_skip_rows_without_a_version() -> None:
    points = eval_points([_row("a", 3, 0.5, 0.5, **{"reward/correct": 0.75}), {"eval/a/strict_accuracy": 1.0}])
    assert [(p.label, p.version, p.time) for p in points] == [("a", 3, 4.5)]
    assert points[0].metrics["reward/correct"] == 0.75 and points[0].metrics["greedy/strict_accuracy"] == 0.25


def test_the_summary_shows_each_set_first_vs_last_and_nothing_without_eval(tmp_path: Path) -> None:
    _append(tmp_path / "metrics.jsonl", *({"step": s, "reward/mean": 0.1 * s} for s in range(1, 6)))
    assert "eval" not in summarize(tmp_path, wall_s=60.0)

    _append(
        tmp_path / "eval.jsonl",
        _row("arithmetic", 0, 0.0, 0.25),
        _row("arithmetic-d2", 0, 0.125, 0.5),
        _row("arithmetic", 2, 0.25, 0.5),
        _row("arithmetic", 5, 0.5, 0.75),
    )
    lines = summarize(tmp_path, wall_s=60.0).splitlines()
    header = next(line for line in lines if line.split()[:1] == ["version"])
    assert header.split() == [
        "version",
        "strict",
        "lenient",
        "pass@1",
        "pass@4",
        "greedy",
        "strict",
        "greedy",
        "lenient",
    ]
    rows = [line.split() for line in lines if line.startswith("    arithmetic")]
    assert rows == [
        ["arithmetic", "v0", "0.000", "0.250", "0.000", "0.000", "0.000", "0.125"],
        ["arithmetic", "v5", "0.500", "0.750", "0.500", "1.000", "0.250", "0.375"],  # v2 is neither first nor last
        ["arithmetic-d2", "v0", "0.125", "0.500", "0.125", "0.250", "0.062", "0.250"],  # one version: one row
    ]
    assert f"  eval rows {tmp_path / 'eval.jsonl'}" in lines
