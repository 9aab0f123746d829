"""The one metrics sink: TensorBoard (`<run_dir>/tb/<stream>`) and JSON lines (`<run_dir>/<stream>.jsonl`).

    sink = MetricsSink(run_dir, stream="metrics")          # the learner: one object per step in metrics.jsonl
    sink.log(step, {"loss/policy": 0.12, "reward/mean": 0.4})
    sink.close()

Keys are namespaced by what they measure: `loss/…`, `policy/…`, `reward/…`, `staleness/…`, `buffer/…`,
`actor/…`, `perf/…`. Every record also carries `step` and `time` (seconds since the sink was created, or
since `start_time` when given, so that all roles of one run share a clock). Imports no torch.

The TensorBoard step is the `step` given: the learner's optimizer step (metrics), the learner version the buffer
knows (buffer) and the policy version a generator samples with (generator-<i>), which all count optimizer steps,
so the curves of every role line up on one axis (TensorBoard's "wall" axis lines them up by time as well).

A sink of a SIMULATION run (`simulation=True`, from `run.simulate`) says so in every record: `"simulation": true`
in JSON, and the description of every TensorBoard series starts with "SIMULATION".
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

SIMULATION_DESCRIPTION = "SIMULATION (run.simulate = true): stand-ins of configured cost replaced vLLM and DeepSpeed"


class MetricsSink:
    """Append-only metrics stream. Not thread-safe: one writer per stream."""

    def __init__(
        self,
        run_dir: Path,
        stream: str = "metrics",
        tensorboard: bool = True,
        start_time: float | None = None,
        simulation: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.simulation = simulation
        self._described: set[str] = set()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.start_time = time.time() if start_time is None else start_time
        self.jsonl_path = self.run_dir / f"{stream}.jsonl"
        self._file = self.jsonl_path.open("a", buffering=1)
        self._writer = None
        if tensorboard:
            from tensorboard.summary import Writer

            self._writer = Writer(str(self.run_dir / "tb" / stream))

    def log(self, step: int, values: dict[str, Any]) -> dict[str, Any]:
        """Write one record; non-finite floats are written as null in JSON (and skipped in TensorBoard)."""
        record: dict[str, Any] = {"step": int(step), "time": round(time.time() - self.start_time, 3)}
        if self.simulation:
            record["simulation"] = True
        for key, value in values.items():
            record[key] = _plain(value)
        self._file.write(json.dumps(record, allow_nan=False, default=str) + "\n")
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(key, float(value), step=int(step), description=self._describe(key))
        return record

    def _describe(self, key: str) -> str | None:
        """The series' description, on its first point only (TensorBoard keeps the first one it reads)."""
        if not self.simulation or key in self._described:
            return None
        self._described.add(key)
        return SIMULATION_DESCRIPTION

    def flush(self) -> None:
        self._file.flush()
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()
        if self._writer is not None:
            self._writer.close()


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
