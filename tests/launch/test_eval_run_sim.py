"""Evaluation during training end to end (issue 16), in SIMULATION: `tandem run` with [eval] on, real buffer, real
sockets, real eval rounds and leases, the simulation engine and trainer.

One run of STEPS learner steps with eval every EVERY versions and at the end: eval.jsonl holds one row per set and
version, at versions 0, EVERY, 2 EVERY, ... and the final one (a round is opened once per version, and one that no
generator leased before a newer round of its set opened is superseded and counted, never silently missing), with
the documented keys; the buffer's eval accounting identity holds at the end with nothing outstanding; the training
ledger identity still holds; metrics.jsonl carries no eval keys; the end summary shows the eval figures.

The same run writes to every tracker (run.trackers: TensorBoard, W&B offline, MLflow's file store), so that the
suite starts one run for both: each stream's tracker runs hold what its JSON lines hold (issue 35).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.eval_metrics import METRIC_KEYS
from common.metrics import read_metrics
from common.trackers import mlflow_name
from launch.testing import RoleUnderTest, run_config
from tests.common.tracker_reads import by_key, mlflow_history, mlflow_run, scalars_of, wandb_history, wandb_records
from tests.launch.ray_runs import buffer_counters

pytestmark = pytest.mark.integration  # starts role processes

STEPS, EVERY = 7, 3
ROUNDS = (0, 3, 6, 7)  # versions 0, EVERY, 2 EVERY and the final one
SETS = {"arithmetic": "arithmetic", "arithmetic-reworded": "arithmetic-reworded"}  # set -> label
PROMPTS, SAMPLES = 4, 2
ROW_METRICS = METRIC_KEYS  # every row holds the metrics tandem eval reports (common.eval_metrics)
RUN_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The run's directory and its launcher's output, after it exited 0."""
    root = tmp_path_factory.mktemp("eval-sim")
    config = run_config(
        root,
        "eval-sim",
        run={"simulate": True, "trackers": ["tensorboard", "wandb", "mlflow"]},
        tracking={"wandb_mode": "offline", "mlflow_uri": (root / "mlruns").as_uri()},
        algo={"group_size": 4, "max_staleness": 1},
        env={"num_prompts": 64},
        # a step of 4 x 4 samples x 0.03 s = 0.48 s: the generator (a round of 8 tokens x 5 ms) has headroom
        learner={"total_steps": STEPS, "groups_per_step": 4, "sim_sample_s": 0.03, "sim_weights_mb": 1.0},
        generator={"sim_tokens": 8, "sim_token_s": 0.005, "prompts_in_flight": 4, "drain_timeout_s": 5},
        eval={"sets": list(SETS), "every": EVERY, "samples": SAMPLES, "max_prompts": PROMPTS, "final_timeout_s": 60},
    )
    launcher = RoleUnderTest(config, "run")
    with launcher:
        code = launcher.wait(RUN_TIMEOUT_S)
    assert code == 0, f"tandem run exited {code}:\n{launcher.tail(8000)}"
    return config.run.run_dir, launcher.output()


def test_eval_rows_come_at_the_round_versions_with_the_documented_keys(run: tuple[Path, str]) -> None:
    run_dir, _ = run
    rows = read_metrics(run_dir / "eval.jsonl")
    counters = buffer_counters(run_dir)
    by_label: dict[str, list[int]] = {}
    for row in rows:
        labels = {key.split("/")[1] for key in row if key.startswith("eval/")}
        assert len(labels) == 1, f"a row holds one set: {sorted(row)}"
        label = labels.pop()
        by_label.setdefault(label, []).append(row["step"])
        prefix = f"eval/{label}/"
        for metric in ROW_METRICS:
            assert prefix + metric in row and prefix + "greedy/" + metric in row, (metric, sorted(row))
        assert row[prefix + "prompts"] == PROMPTS and row[prefix + "samples"] == PROMPTS * SAMPLES
        assert row[prefix + "greedy/samples"] == PROMPTS and row[prefix + "k"] == SAMPLES
        assert row[prefix + "learner_version"] >= row["step"]  # evaluation trails training, never leads it
        assert row[prefix + "wall_s"] >= 0 and row["simulation"] is True
    assert set(by_label) == set(SETS.values())
    for label, versions in by_label.items():
        assert versions == sorted(set(versions)), f"{label}: one row per version, in version order: {versions}"
        assert {0, STEPS} <= set(versions) <= set(ROUNDS), (label, versions)
    # a round version with no row was superseded (no generator leased it before the next round of its set opened)
    assert len(rows) + counters["eval_superseded"] == len(ROUNDS) * len(SETS), (len(rows), counters)
    assert counters["eval_results_accepted"] == len(rows) and counters["eval_rounds_opened"] == len(ROUNDS)


def test_the_eval_identity_and_the_training_ledger_hold_at_the_end(run: tuple[Path, str]) -> None:
    run_dir, _ = run
    c = buffer_counters(run_dir)
    assert c["eval_issued"] == c["eval_done"] + c["eval_requeued"] + c["eval_outstanding"], c
    assert c["eval_outstanding"] == 0 and c["eval_final_pending"] == 0 and c["eval_final_timed_out"] == 0
    assert c["eval_done"] == PROMPTS * c["eval_results_accepted"]  # a done lease is a whole set of PROMPTS
    assert c["eval_leases_issued"] >= c["eval_results_accepted"]
    assert c["arrived"] == c["trained"] + c["dropped_stale"] + c["evicted"] + c["rejected"] + c["buffered"], c
    assert c["trained_groups"] == STEPS * 4  # eval prompts never reached training: steps x groups_per_step


def test_eval_stays_out_of_metrics_jsonl_and_shows_in_the_summary(run: tuple[Path, str]) -> None:
    run_dir, output = run
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert not [key for record in records for key in record if key.startswith("eval/")]
    assert "eval (first vs last version evaluated)" in output, output[-3000:]
    for label in SETS.values():
        assert f"    {label} " in output and f"v{STEPS}" in output
    assert (run_dir / "tb" / "eval").is_dir()


def test_every_stream_reaches_wandb_and_mlflow_as_its_json_lines(run: tuple[Path, str]) -> None:
    """The learner's steps, the generator, the buffer and the evaluation rows: each stream's W&B run (offline) and
    MLflow run hold its records' numbers at its steps, in order (tests/common/test_trackers.py checks the sink)."""
    run_dir, _ = run
    uri = (run_dir.parent / "mlruns").as_uri()
    streams = {path.stem: json.loads(path.read_text()) for path in (run_dir / "trackers").glob("*.json")}
    assert set(streams) == {"metrics", "buffer", "eval", "generator-0"}, sorted(streams)
    for stream, ids in streams.items():
        expected = scalars_of(run_dir / f"{stream}.jsonl")
        assert expected, stream
        assert wandb_history(run_dir, ids["wandb"]) == expected, stream
        assert mlflow_history(uri, ids["mlflow"]) == by_key(expected, mlflow_name), stream
        tags = mlflow_run(uri, ids["mlflow"]).data.tags
        assert tags["tandem.stream"] == stream and tags["tandem.simulation"] == "true"
        header = next(r["run"] for r in wandb_records(run_dir, ids["wandb"]) if r.get("type") == "run")
        assert header["run_group"] == "eval-sim" and header["config"]["update"]["eval"]["every"] == EVERY
