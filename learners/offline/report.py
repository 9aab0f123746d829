"""What an offline stage (`learners.offline.loop`) reports: the step line's stage keys, the held-out line, and
`<run_dir>/summary.json` (the first and the last evaluation, read back from metrics.jsonl)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from common.config import TandemConfig
from common.trackers import Trackers

SUMMARY_FILE = "summary.json"
MODEL_DIR = "model"  # <run_dir>/model: the stage's final Hugging Face export

EVAL_KEYS = {"sft": ("loss",), "rm": ("loss", "accuracy", "margin"), "dpo": ("loss", "accuracy", "margin")}


def eval_line(name: str, values: dict[str, Any]) -> str:
    return " ".join(f"{key} {values[f'eval/{name}/{key}']:.4f}" for key in EVAL_KEYS[name])


def make_reporter(config: TandemConfig, name: str, total_steps: int, first_step: int, log: logging.Logger) -> Any:
    """Rank 0's StepReporter of stage `name`: its bar labelled with the stage, the line its train and held-out keys."""
    from learners.reporting import StepReporter

    def info(values: dict[str, Any]) -> str:
        text = " ".join(f"{key} {values[f'{name}/{key}']:.4f}" for key in EVAL_KEYS[name])
        if f"eval/{name}/loss" in values:
            text += f" | held-out {eval_line(name, values)}"
        return f"{text} {values['perf/train_tokens_per_s']:,.0f} tok/s"

    return StepReporter(
        config.run.run_dir, total_steps, first_step, log, label=name, info=info, trackers=Trackers.from_config(config)
    )


def write_summary(run_dir: Path, name: str, steps: int) -> dict[str, Any]:
    """`<run_dir>/summary.json` from metrics.jsonl (so a resumed run's first evaluation counts too): the stage,
    its steps, the first and the last evaluation ({"step": s, "eval/<stage>/...": ...}) and the model dir."""
    from common.metrics import read_metrics

    evaluations = [
        {"step": record["step"], **{k: v for k, v in record.items() if k.startswith("eval/")}}
        for record in read_metrics(run_dir / "metrics.jsonl")
        if any(key.startswith("eval/") for key in record)
    ]
    summary = {
        "stage": name,
        "steps": steps,
        "first_eval": evaluations[0] if evaluations else None,
        "last_eval": evaluations[-1] if evaluations else None,
        "model": str(run_dir / MODEL_DIR),
    }
    tmp = run_dir / (SUMMARY_FILE + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(run_dir / SUMMARY_FILE)
    return summary


def summary_line(summary: dict[str, Any]) -> str:
    """The done line's "key first -> last" of each held-out metric in `summary`."""
    first, last = summary["first_eval"], summary["last_eval"]
    if not first:
        return "no held-out evaluation"
    keys = [key for key in last if key != "step"]
    return ", ".join(f"{key} {first.get(key, float('nan')):.4f} -> {last[key]:.4f}" for key in keys)
