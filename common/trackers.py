"""Experiment trackers: TensorBoard, Weights & Biases and MLflow, each a copy of what `<stream>.jsonl` gets.

    trackers = Trackers.from_config(config)               # run.trackers and [tracking], with the resolved config
    sink = MetricsSink(run_dir, "buffer", trackers=trackers)  # common.metrics: every record to every tracker

A stream is one writer's series: `metrics` (the learner's steps), `generator-<i>`, `buffer`, `eval`, `reward-0`.
Each stream is one tracker run, as TensorBoard has one folder per stream (`tb/<stream>`): the W&B run
`<run>/<stream>` in the group `<run>` (job type `<stream>`), the MLflow run `<stream>` in the experiment `<run>`
(tags `tandem.run`, `tandem.stream`). Metric names and steps are the stream's (`loss/policy` at step 12 is
`loss/policy` at step 12 everywhere; W&B plots them against its `step` metric; MLflow, which refuses `@` in a
name, has `pass_at_k` for `pass@k`). Each tracker run gets the run's
resolved config (W&B's config; MLflow's params, flattened `section.key`, and `config.json`).

Resume: the tracker run ids are kept in `<run_dir>/trackers/<stream>.json`; a role that starts again on the same run
directory continues them (W&B `resume="allow"`, MLflow's run set running again).

Failure: W&B and MLflow are imported only when chosen, opened and written from a thread of their own, so a role
never waits on them. One that fails to open within `tracking.init_timeout_s`, or fails to write, is logged once
and dropped for the rest of the process: training goes on, and `<stream>.jsonl` has every record.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

SIMULATION_DESCRIPTION = "SIMULATION (run.simulate = true): stand-ins of configured cost replaced vLLM and DeepSpeed"
QUEUE_RECORDS = 10_000  # records a slow tracker may fall behind by before its oldest are dropped (and counted)
CLOSE_WAIT_S = 30.0  # how long closing a stream waits for a tracker to send what it was given


class Tracker(Protocol):
    name: str
    run_id: str  # the tracker's own id of this stream's run ("" for TensorBoard)

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Trackers:
    """What a run's sinks open besides their JSON lines: tracker names (run.trackers) and their settings."""

    names: tuple[str, ...] = ("tensorboard",)
    run_name: str = "tandem"
    root: Path = Path("runs")
    wandb_project: str = "tandem"
    wandb_entity: str | None = None
    wandb_mode: str | None = None
    mlflow_uri: str | None = None
    mlflow_experiment: str | None = None
    init_timeout_s: float = 30.0
    config: dict[str, Any] = field(default_factory=dict)  # the run's resolved config, as JSON data

    @classmethod
    def from_config(cls, config: Any) -> Trackers:
        tracking = config.tracking
        return cls(
            names=tuple(config.run.trackers),
            run_name=config.run.name,
            root=config.run.root,
            wandb_project=tracking.wandb_project,
            wandb_entity=tracking.wandb_entity,
            wandb_mode=tracking.wandb_mode,
            mlflow_uri=tracking.mlflow_uri,
            mlflow_experiment=tracking.mlflow_experiment,
            init_timeout_s=tracking.init_timeout_s,
            config=config.model_dump(mode="json"),
        )

    def open(self, run_dir: Path, stream: str, simulation: bool) -> list[Tracker]:
        """This stream's trackers; one that cannot be opened is logged and left out."""
        ids = TrackerIds(Path(run_dir) / "trackers" / f"{stream}.json")
        opened: list[Tracker] = []
        for name in self.names:
            if name == "tensorboard":
                opened.append(TensorBoardTracker(Path(run_dir) / "tb" / stream, simulation))
                continue
            start, run_id = OPENERS[name], ids.get(name)
            tracker = Background(name, lambda s=start, i=run_id: s(self, Path(run_dir), stream, simulation, i))
            if tracker.wait_open(self.init_timeout_s):
                ids.set(name, tracker.run_id)
                opened.append(tracker)
        return opened


class TensorBoardTracker:
    """`<run_dir>/tb/<stream>`: in SIMULATION every series' description says so (on its first point: TensorBoard
    keeps the first description it reads)."""

    name = "tensorboard"
    run_id = ""

    def __init__(self, folder: Path, simulation: bool) -> None:
        from tensorboard.summary import Writer

        self.writer = Writer(str(folder))
        self.simulation = simulation
        self.described: set[str] = set()

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step=step, description=self._describe(key))

    def _describe(self, key: str) -> str | None:
        if not self.simulation or key in self.described:
            return None
        self.described.add(key)
        return SIMULATION_DESCRIPTION

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run per stream (offline runs under `<run_dir>/trackers/wandb`)."""

    name = "wandb"

    def __init__(self, spec: Trackers, run_dir: Path, stream: str, simulation: bool, run_id: str | None) -> None:
        import wandb

        folder = run_dir / "trackers"
        folder.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, init_timeout=spec.init_timeout_s)
        self.run = wandb.init(
            project=spec.wandb_project,
            entity=spec.wandb_entity,
            group=spec.run_name,
            name=f"{spec.run_name}/{stream}",
            job_type=stream,
            id=run_id,
            resume="allow",
            dir=str(folder),
            mode=spec.wandb_mode,
            config=spec.config,
            tags=["SIMULATION"] if simulation else None,
            reinit="create_new",  # a process may write several streams (the buffer: buffer and eval)
            settings=settings,
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # TensorBoard's axis: points that share a step all stay
        self.run_id = self.run.id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**scalars, "step": step})

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


def mlflow_name(key: str) -> str:
    """A metric's name in MLflow, which allows letters, digits, `_ - . : /` and spaces only: `pass@k` is
    `pass_at_k` there, and any other character `_`."""
    return _NOT_IN_MLFLOW_NAMES.sub("_", key.replace("@", "_at_"))


_NOT_IN_MLFLOW_NAMES = re.compile(r"[^A-Za-z0-9_\-. :/]")


class MlflowTracker:
    """An MLflow run per stream, in the experiment `tracking.mlflow_experiment` (default: the run's name). Metric
    names are the stream's but for what MLflow refuses (`mlflow_name`: `eval/<set>/pass@1` is `.../pass_at_1`)."""

    name = "mlflow"

    def __init__(self, spec: Trackers, run_dir: Path, stream: str, simulation: bool, run_id: str | None) -> None:
        uri = (
            spec.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or (Path(spec.root) / "mlruns").resolve().as_uri()
        )
        if uri.startswith(("file:", "/", ".")):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # asked for by name: MLflow 3 refuses it else
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        if run_id and self._exists(run_id):
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        with _locked(run_dir / "trackers" / "mlflow.lock"):  # the roles of a run start together: one experiment
            name = spec.mlflow_experiment or spec.run_name
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        tags = {"tandem.run": spec.run_name, "tandem.stream": stream, "tandem.simulation": str(simulation).lower()}
        self.run_id = self.client.create_run(experiment_id, run_name=stream, tags=tags).info.run_id
        self._log_config(spec.config)

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def _log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(key, str(value)[:6000]) for key, value in sorted(flatten(config).items())]
        for first in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=params[first : first + 100])
        self.client.log_dict(self.run_id, config, "config.json")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(key), value, now_ms, step) for key, value in scalars.items()]
        for first in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[first : first + 1000])

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


OPENERS: dict[str, Callable[..., Tracker]] = {"wandb": WandbTracker, "mlflow": MlflowTracker}


class Background:
    """A tracker opened and written from a thread of its own: `log` only queues. A failure (opening, writing,
    closing) is logged once and the tracker dropped; a tracker more than QUEUE_RECORDS behind loses its oldest
    records (`dropped` counts them)."""

    def __init__(self, name: str, opener: Callable[[], Tracker]) -> None:
        self.name = name
        self.run_id = ""
        self.failed = False
        self.dropped = 0
        self.records: queue.Queue[tuple[int, dict[str, float]] | None] = queue.Queue(QUEUE_RECORDS)
        self.opened = threading.Event()
        self.thread = threading.Thread(target=self._work, args=(opener,), name=f"tracker-{name}", daemon=True)
        self.thread.start()

    def wait_open(self, timeout_s: float) -> bool:
        if not self.opened.wait(timeout_s):
            self._fail(f"did not start within tracking.init_timeout_s = {timeout_s:g}s")
        return not self.failed

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self.failed:
            return
        while True:
            try:
                self.records.put_nowait((step, scalars))
                return
            except queue.Full:
                try:
                    self.records.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        if self.failed:
            return
        self.records.put(None)
        self.thread.join(CLOSE_WAIT_S)
        if self.thread.is_alive():
            self._fail(f"still sending after {CLOSE_WAIT_S:g}s at the end: left behind")

    def _work(self, opener: Callable[[], Tracker]) -> None:
        try:
            tracker = opener()
        except Exception as error:  # noqa: BLE001 - any failure of a tracker leaves training alone
            self._fail(f"could not start: {type(error).__name__}: {error}")
            self.opened.set()
            return
        self.run_id = tracker.run_id
        self.opened.set()
        if self.failed:  # opened after tracking.init_timeout_s: left behind, but closed
            tracker.close()
            return
        try:
            while (record := self.records.get()) is not None:
                if self.failed:
                    return
                tracker.log(*record)
            tracker.close()
        except Exception as error:  # noqa: BLE001
            self._fail(f"failed: {type(error).__name__}: {error}")

    def _fail(self, why: str) -> None:
        if not self.failed:
            self.failed = True
            log.warning(
                "tracker %s %s; it is off for the rest of this process (the JSON lines and TensorBoard keep every "
                "record; see [tracking] and run.trackers)",
                self.name,
                why,
            )


class TrackerIds:
    """`<run_dir>/trackers/<stream>.json`: each tracker's run id for this stream, so that a restart continues it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _read(self) -> dict[str, str]:
        try:
            ids = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}

    def get(self, name: str) -> str | None:
        return self._read().get(name)

    def set(self, name: str, run_id: str) -> None:
        ids = {**self._read(), name: run_id}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(ids, indent=1))
        temporary.replace(self.path)  # whole or not at all: a torn file would start new tracker runs


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"run": {"name": "x"}} -> {"run.name": "x"}: the config as MLflow params."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
