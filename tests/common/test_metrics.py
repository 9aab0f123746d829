"""The metrics sink writes one JSON object per call and the same scalars to TensorBoard."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util.tensor_util import make_ndarray

from common.metrics import MetricsSink, read_metrics


def test_jsonl_and_tensorboard(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path, "metrics")
    for step in range(3):
        sink.log(step, {"reward/mean": 0.5 * step, "loss/policy": float("nan"), "note": "x"})
    sink.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[2]["reward/mean"] == 1.0 and records[0]["loss/policy"] is None and "time" in records[0]
    events = EventAccumulator(str(tmp_path / "tb" / "metrics"))
    events.Reload()
    # tensorboard.summary writes v2 scalar summaries: TensorBoard shows them as scalars, the accumulator as tensors
    assert [float(make_ndarray(e.tensor_proto)) for e in events.Tensors("reward/mean")] == [0.0, 0.5, 1.0]


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, "rew')
    assert read_metrics(path) == [{"step": 0}]


def test_a_simulation_sink_says_so_in_every_record_and_series(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path, "buffer", simulation=True)
    for version in (0, 0, 2):  # the TensorBoard step is the step given (a role's policy version), repeats included
        sink.log(version, {"buffer/arrived": 4})
    sink.close()
    assert [r["simulation"] for r in read_metrics(tmp_path / "buffer.jsonl")] == [True] * 3
    events = EventAccumulator(str(tmp_path / "tb" / "buffer"))
    events.Reload()
    assert [e.step for e in events.Tensors("buffer/arrived")] == [0, 0, 2]
    assert events.SummaryMetadata("buffer/arrived").summary_description.startswith("SIMULATION")
    assert "simulation" not in events.Tags()["tensors"]  # a flag, not a curve
