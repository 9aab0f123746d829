"""The one metrics sink: JSON lines (`<run_dir>/<stream>.jsonl`) and the run's trackers (common.trackers:
TensorBoard in `<run_dir>/tb/<stream>` by default; Weights & Biases and MLflow when `run.trackers` names them).

    sink = MetricsSink(run_dir, stream="metrics", trackers=Trackers.from_config(config))  # the learner
    sink.log(step, {"loss/policy": 0.12, "reward/mean": 0.4})   # one object per step in metrics.jsonl
    sink.close()

Keys are namespaced by what they measure: `loss/…`, `policy/…`, `reward/…`, `staleness/…`, `buffer/…`,
`actor/…`, `perf/…`. Every record also carries `step` and `time` (seconds since the sink was created, or
since `start_time` when given, so that all roles of one run share a clock). Imports no torch.

The TensorBoard step is the `step` given: the learner's optimizer step (metrics), the learner version the buffer
knows (buffer) and the policy version a generator samples with (generator-<i>), which all count optimizer steps,
so the curves of every role line up on one axis (TensorBoard's "wall" axis lines them up by time as well).

A sink of a SIMULATION run (`simulation=True`, from `run.simulate`) says so in every record: `"simulation": true`
in JSON, the description of every TensorBoard series starts with "SIMULATION", W&B tags the run SIMULATION and
MLflow `tandem.simulation`.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from common.trackers import SIMULATION_DESCRIPTION, Tracker, Trackers

__all__ = ["SIMULATION_DESCRIPTION", "MetricsSink", "read_metrics"]


class MetricsSink:
    """Append-only metrics stream. Not thread-safe: one writer per stream."""

    def __init__(
        self,
        run_dir: Path,
        stream: str = "metrics",
        tensorboard: bool = True,
        start_time: float | None = None,
        simulation: bool = False,
        trackers: Trackers | None = None,
    ) -> None:
        """`trackers` (the run's, `Trackers.from_config`) wins over `tensorboard`, which alone means TensorBoard
        or nothing besides the JSON lines."""
        self.run_dir = Path(run_dir)
        self.simulation = simulation
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.start_time = time.time() if start_time is None else start_time
        self.jsonl_path = self.run_dir / f"{stream}.jsonl"
        self._file = self.jsonl_path.open("a", buffering=1)
        spec = trackers if trackers is not None else Trackers(names=("tensorboard",) if tensorboard else ())
        self.trackers: list[Tracker] = spec.open(self.run_dir, stream, simulation)

    def log(self, step: int, values: dict[str, Any]) -> dict[str, Any]:
        """Write one record; non-finite floats are written as null in JSON (and left out for the trackers, which
        get every number but `step`, as TensorBoard always had)."""
        record: dict[str, Any] = {"step": int(step), "time": round(time.time() - self.start_time, 3)}
        if self.simulation:
            record["simulation"] = True
        for key, value in values.items():
            record[key] = _plain(value)
        self._file.write(json.dumps(record, allow_nan=False, default=str) + "\n")
        scalars = {
            key: float(value)
            for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        for tracker in self.trackers:
            tracker.log(int(step), scalars)
        return record

    def flush(self) -> None:
        self._file.flush()
        for tracker in self.trackers:
            tracker.flush()

    def close(self) -> None:
        self._file.flush()
        self._file.close()
        for tracker in self.trackers:
            tracker.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # numpy / torch scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file (a torn last line, from a crash mid-write, is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
