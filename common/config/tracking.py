"""`[tracking]`: where the experiment trackers chosen by `run.trackers` (wandb, mlflow) put a run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from common.config.base import MAX_TIMEOUT_S, _Section

TRACKERS = ("tensorboard", "wandb", "mlflow")  # run.trackers: what common.trackers can write to


class TrackingConfig(_Section):
    """Settings of the trackers that `run.trackers` names beside TensorBoard. Every role that writes metrics (the
    learner's steps, each generator, the buffer, evaluation rows, the reward service) writes them to each tracker
    too, one tracker run per stream as TensorBoard has one folder per stream (`tb/<stream>`), with the same metric
    names and steps. The run's resolved config goes with it. A role that restarts continues its tracker run (the
    ids are kept in `<run_dir>/trackers/<stream>.json`). A tracker that fails (no network, a bad key) is logged once
    and dropped: training never stops for it (common/trackers.py)."""

    wandb_project: str = Field("tandem", description="Weights & Biases project.", min_length=1)
    wandb_entity: str | None = Field(None, description="Weights & Biases entity (team or user); unset: your default.")
    wandb_mode: Literal["online", "offline"] | None = Field(
        None,
        description="`online` (sent as it runs; needs WANDB_API_KEY or `wandb login`), `offline` (written under "
        "`<run_dir>/trackers/wandb`, sent later with `wandb sync`); unset: wandb's own choice (WANDB_MODE, else "
        "online). Each stream is a W&B run named `<run.name>/<stream>` in the group `<run.name>`.",
    )
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI: a server (`http://host:5000`, `databricks`) or a local file store "
        "(`file:/path/mlruns`; Tandem opts into MLflow's file store, which MLflow 3 keeps in maintenance mode). "
        "Unset: MLFLOW_TRACKING_URI, else the file store `<run.root>/mlruns`.",
    )
    mlflow_experiment: str | None = Field(
        None,
        description="MLflow experiment; unset: the run's name. Each stream is an MLflow run named after it, tagged "
        "`tandem.run` and `tandem.stream`.",
    )
    init_timeout_s: float = Field(
        30.0,
        description="How long a role waits for a tracker to start (wandb online without network) before it logs "
        "the failure and goes on without that tracker.",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
