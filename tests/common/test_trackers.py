"""Experiment trackers (common/trackers.py): what a sink writes to metrics.jsonl reaches W&B (offline) and MLflow (a
local file store), read back with their own tools; a restart continues the same tracker runs; a tracker that fails
is logged once and never stops the writer."""

from __future__ import annotations

import json
import logging
import math
import threading
from pathlib import Path

import pytest

from common.metrics import MetricsSink, read_metrics
from common.trackers import Background, TrackerIds, Trackers, flatten, mlflow_name
from tests.common.tracker_reads import (
    by_key,
    mlflow_client,
    mlflow_history,
    mlflow_run,
    scalars_of,
    wandb_history,
    wandb_records,
)

RECORDS = [  # two points at one step (the buffer reports several times a version), a NaN, a flag, a late key
    (0, {"loss/policy": 0.5, "reward/mean": 0.25, "done": True}),
    (0, {"loss/policy": 0.4, "reward/mean": float("nan")}),
    (1, {"loss/policy": 0.3, "reward/mean": 0.75, "perf/tokens_per_s": 1234}),
]


@pytest.fixture
def both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Trackers:
    monkeypatch.setenv("WANDB_SILENT", "true")
    return Trackers(
        names=("tensorboard", "wandb", "mlflow"),
        run_name="tracked",
        root=tmp_path,
        wandb_mode="offline",
        mlflow_uri=(tmp_path / "mlruns").as_uri(),
        config={"run": {"name": "tracked"}, "algo": {"max_staleness": 2, "group_size": 4}},
    )


@pytest.mark.integration  # W&B starts its service process
def test_wandb_offline_and_mlflow_get_what_metrics_jsonl_got_and_a_restart_continues_them(
    tmp_path: Path, both: Trackers
) -> None:
    run_dir = tmp_path / "tracked"
    sink = MetricsSink(run_dir, "buffer", trackers=both)
    assert [t.name for t in sink.trackers] == ["tensorboard", "wandb", "mlflow"]
    for step, values in RECORDS[:2]:
        sink.log(step, values)
    sink.close()
    ids = json.loads((run_dir / "trackers" / "buffer.json").read_text())

    again = MetricsSink(run_dir, "buffer", trackers=both)  # a restarted role: the same tracker runs
    assert {t.name: t.run_id for t in again.trackers if t.name != "tensorboard"} == ids
    again.log(*RECORDS[2])
    again.close()

    expected = scalars_of(run_dir / "buffer.jsonl")
    assert len(expected) == 3 and "done" not in expected[0][1] and "reward/mean" not in expected[1][1]
    assert wandb_history(run_dir, ids["wandb"]) == expected  # W&B keeps both points of step 0, in order
    assert mlflow_history(both.mlflow_uri, ids["mlflow"]) == by_key(expected)

    run = mlflow_run(both.mlflow_uri, ids["mlflow"])
    assert run.info.run_name == "buffer" and run.data.tags["tandem.run"] == "tracked"
    assert run.data.params == {"run.name": "tracked", "algo.max_staleness": "2", "algo.group_size": "4"}
    assert mlflow_client(both.mlflow_uri).get_experiment(run.info.experiment_id).name == "tracked"
    header = next(r["run"] for r in wandb_records(run_dir, ids["wandb"]) if r.get("type") == "run")
    assert header["display_name"] == "tracked/buffer" and header["run_group"] == "tracked"
    assert header["config"]["update"]["algo"] == {"max_staleness": 2, "group_size": 4}


def test_a_tracker_that_cannot_start_is_logged_once_and_the_sink_writes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object) -> None:
        raise PermissionError("wandb: invalid API key")

    monkeypatch.setitem(__import__("common.trackers").trackers.OPENERS, "wandb", refuse)
    with caplog.at_level(logging.WARNING, "common.trackers"):
        sink = MetricsSink(tmp_path, "metrics", trackers=Trackers(names=("wandb",), init_timeout_s=10))
        sink.log(0, {"x": 1.0})
        sink.close()
    assert sink.trackers == []
    assert caplog.messages == [
        (
            "tracker wandb could not start: PermissionError: wandb: invalid API key; it is off for the rest of this "
            "process (the JSON lines and TensorBoard keep every record; see [tracking] and run.trackers)"
        )
    ]
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["x"] == 1


class Flaky:
    """A tracker whose second write fails (a network gone mid-run)."""

    name, run_id = "flaky", "id-1"

    def __init__(self) -> None:
        self.logged: list[int] = []

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if len(self.logged) == 1:
            raise ConnectionError("network unreachable")
        self.logged.append(step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_tracker_that_fails_mid_run_is_dropped_after_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    flaky = Flaky()
    tracker = Background("flaky", lambda: flaky)
    assert tracker.wait_open(5) and tracker.run_id == "id-1"
    with caplog.at_level(logging.WARNING, "common.trackers"):
        for step in range(5):
            tracker.log(step, {"x": float(step)})
        tracker.close()
    assert flaky.logged == [0] and tracker.failed
    assert len(caplog.records) == 1 and "flaky failed: ConnectionError: network unreachable" in caplog.messages[0]


def test_a_tracker_that_hangs_at_start_is_left_behind_after_the_timeout(caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    tracker = Background("slow", lambda: (release.wait(30), Flaky())[1])
    with caplog.at_level(logging.WARNING, "common.trackers"):
        assert not tracker.wait_open(0.2)
    release.set()
    tracker.log(0, {"x": 1.0})  # ignored: the writer never waits on it again
    assert "tracker slow did not start within tracking.init_timeout_s = 0.2s" in caplog.messages[0]


def test_a_tracker_that_falls_behind_loses_its_oldest_records_and_counts_them(monkeypatch) -> None:
    monkeypatch.setattr("common.trackers.QUEUE_RECORDS", 2)
    release, written = threading.Event(), []

    class Stuck(Flaky):
        def log(self, step: int, scalars: dict[str, float]) -> None:
            release.wait(30)
            written.append(step)

    tracker = Background("stuck", Stuck)
    assert tracker.wait_open(5)
    tracker.log(0, {})
    while tracker.records.qsize():  # the thread holds record 0 in Stuck.log
        threading.Event().wait(0.01)
    for step in range(1, 6):
        tracker.log(step, {})
    release.set()
    tracker.close()
    assert written == [0, 4, 5] and tracker.dropped == 3


def test_ids_survive_a_restart_and_a_torn_file_starts_afresh(tmp_path: Path) -> None:
    ids = TrackerIds(tmp_path / "trackers" / "buffer.json")
    assert ids.get("wandb") is None
    ids.set("wandb", "abc")
    ids.set("mlflow", "0123")
    assert TrackerIds(ids.path).get("wandb") == "abc" and TrackerIds(ids.path).get("mlflow") == "0123"
    ids.path.write_text('{"wandb": "ab')  # torn: new tracker runs, never a crash
    assert ids.get("wandb") is None


def test_mlflow_names_keep_what_mlflow_allows() -> None:
    assert mlflow_name("eval/arithmetic/greedy/pass@1") == "eval/arithmetic/greedy/pass_at_1"
    assert mlflow_name("loss/policy") == "loss/policy" and mlflow_name("a b:c-d.e_f") == "a b:c-d.e_f"
    assert mlflow_name("reward/µ[0]") == "reward/__0_"


def test_the_config_flattens_to_mlflow_params() -> None:
    assert flatten({"run": {"name": "x", "trackers": ["wandb"]}, "eval": {"sets": []}, "ray": {}}) == {
        "run.name": "x",
        "run.trackers": ["wandb"],
        "eval.sets": [],
        "ray": {},
    }


def test_tensorboard_alone_is_the_default_and_an_empty_list_leaves_the_json_lines(tmp_path: Path) -> None:
    from common.config import load_config

    config = load_config(None, {"run.root": str(tmp_path)})
    assert Trackers.from_config(config).names == ("tensorboard",)
    sink = MetricsSink(tmp_path / "a", "metrics", trackers=Trackers.from_config(config))
    sink.log(0, {"x": 1.0})
    sink.close()
    assert list((tmp_path / "a" / "tb" / "metrics").iterdir())
    quiet = load_config(None, {"run.root": str(tmp_path), "run.trackers": []})
    sink = MetricsSink(tmp_path / "b", "metrics", trackers=Trackers.from_config(quiet))
    sink.log(0, {"x": math.pi})
    sink.close()
    assert not (tmp_path / "b" / "tb").exists() and read_metrics(tmp_path / "b" / "metrics.jsonl")[0]["x"] == math.pi


def test_a_role_refuses_to_start_with_a_tracker_this_machine_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    from common.config import load_config
    from launch import config_checks

    config = load_config(None, {"run.trackers": ["tensorboard", "wandb", "mlflow"]})
    assert [p for p in config_checks.missing_paths(config, "learner") if p.startswith("run.trackers")] == []
    monkeypatch.setattr(config_checks, "_installed", lambda name: name != "mlflow")
    for role in ("run", "buffer", "generator", "learner", "reward", "sft"):
        assert config_checks.missing_paths(config, role)[-1] == (
            "run.trackers: mlflow not installed on this machine: `pip install 'tandem-rl[trackers]'` "
            "(scripts/setup.sh does), or leave it out of run.trackers"
        ), role
