"""Reading back what a run's trackers got, with the trackers' own tools: W&B's `wandb leet inspect --json` (its
reader of an offline run's transaction log) and MLflow's `MlflowClient`; and what they should have got (the
stream's JSON lines)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from common.metrics import read_metrics


def scalars_of(jsonl: Path) -> list[tuple[int, dict[str, float]]]:
    """What every tracker must have got: each record's numbers (not `step`, flags or nulls), by step."""
    return [
        (
            record["step"],
            {
                key: float(value)
                for key, value in record.items()
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
            },
        )
        for record in read_metrics(jsonl)
    ]


def wandb_records(run_dir: Path, run_id: str) -> list[dict]:
    """Every record of the offline W&B runs `run_id` under `run_dir`, in the order written, read by `wandb leet
    inspect --json` (W&B's own reader of its transaction log)."""
    logs = sorted(run_dir.glob(f"trackers/wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert logs, f"no offline W&B run {run_id} under {run_dir}"
    wandb = Path(sys.executable).with_name("wandb")
    records = []
    for path in logs:
        out = subprocess.run(
            [str(wandb), "leet", "inspect", "--json", str(path)], capture_output=True, text=True, check=True
        )
        records.extend(json.loads(line) for line in out.stdout.splitlines())
    return records


def wandb_history(run_dir: Path, run_id: str) -> list[tuple[int, dict[str, float]]]:
    """The W&B runs' history rows as (step, metrics), W&B's own keys (`_step`, `_runtime`...) left out."""
    rows = []
    for record in wandb_records(run_dir, run_id):
        if record.get("type") == "history":
            item = record["history"]["item"]
            rows.append((int(item["step"]), {k: float(v) for k, v in item.items() if k[0] != "_" and k != "step"}))
    return rows


def mlflow_history(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """The MLflow run's metrics by MlflowClient: each key's (step, value) points in the order logged."""
    client = mlflow_client(uri)
    return {
        key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        for key in client.get_run(run_id).data.metrics
    }


def by_key(
    rows: list[tuple[int, dict[str, float]]], name: Callable[[str], str] = str
) -> dict[str, list[tuple[int, float]]]:
    """Records as series: {name(key): [(step, value), ...]}."""
    series: dict[str, list[tuple[int, float]]] = {}
    for step, values in rows:
        for key, value in values.items():
            series.setdefault(name(key), []).append((step, value))
    return series


def mlflow_run(uri: str, run_id: str):
    return mlflow_client(uri).get_run(run_id)


def mlflow_client(uri: str):
    """A reader of the store at `uri`; a `file:` store is opted into as common.trackers does for its writers."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)
