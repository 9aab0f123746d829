"""Whether a run may write into its run directory: two runs never share one file.

    problem = reuse_problem(config.run.run_dir, config.learner.resume, whole_run=True)   # tandem run / tandem ray
    problem = reuse_problem(config.run.run_dir, config.learner.resume, whole_run=False)  # a learner alone

Without `learner.resume`, a directory that already holds a run is refused before anything is written, with one
line that says what to do (resume it, choose another run.name, or move the folder aside); otherwise a second run
would append to the first one's metrics.jsonl (steps 1, 2, 3, 1, 2, 3). With it, the learner continues the run and
drops the records of steps after its checkpoint (`learners.checkpoint.trim_records`).

What counts as a run: for a launcher that starts every role (`whole_run`), any record (a `*.jsonl` stream, a
checkpoint, TensorBoard events); for a learner started alone, only its own (metrics.jsonl, checkpoints/), since the
buffer and the generators of its run may have started before it. The resolved config.json and logs/ do not count:
a harness writes the config before it starts the launcher, and the logs of a failed start are appended to.
"""

from __future__ import annotations

from pathlib import Path

LEARNER_RECORDS = ("metrics.jsonl", "checkpoints")


def reuse_problem(run_dir: Path, resume: bool, whole_run: bool) -> str | None:
    """None when the run may write into `run_dir`, else the one-line reason (see the module docstring)."""
    if resume:
        return None
    run_dir = Path(run_dir)
    found = [name for name in LEARNER_RECORDS if _holds_records(run_dir / name)]
    if whole_run:
        found += sorted(p.name for p in run_dir.glob("*.jsonl") if p.name not in found and _holds_records(p))
        found += ["tb"] if _holds_records(run_dir / "tb") else []
    if not found:
        return None
    return (
        f"run.name: {run_dir} already holds a run ({', '.join(found)}): pass --learner.resume true to continue it, "
        f"choose a new --run.name, or move {run_dir} aside"
    )


def _holds_records(path: Path) -> bool:
    """A non-empty file, or a folder with something in it."""
    if path.is_dir():
        return any(path.iterdir())
    return path.is_file() and path.stat().st_size > 0
