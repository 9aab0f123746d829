"""`tandem learner` as a real process over real loopback sockets, fed by a fake buffer, watched by a fake
generator: it trains, publishes weights byte-equal to its own HF export, checkpoints, is SIGKILLed, resumes
from the last complete checkpoint and continues at the next version. Plus the simulation stand-in."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

from common.metrics import read_metrics
from common.sockets import Client, SocketSecurity
from common.weight_messages import WeightsNotNewer
from launch.testing import RoleUnderTest
from learners.sim_trainer import SimulatedTrainer
from tests.learners.learner_fakes import (
    SyntheticBuffer,
    fetch_weights,
    learner_config,
    process_config,
    safetensors_bytes,
    synthetic_batch,
)

REQUIRED_METRICS = [
    "step",
    "policy_version",
    "time",
    "reward/mean",
    "reward/std",
    "staleness/mean",
    "staleness/max",
    "staleness/frac_0",
    "staleness/frac_1",
    "buffer/dropped_stale",
    "buffer/dropped_no_signal",
    "buffer/no_signal_reward_sum",
    "perf/train_tokens_per_s",
    "perf/interval_s",
    "throughput/samples_per_s",
    "throughput/tokens_per_s",
    "throughput/session_samples_per_s",
    "throughput/session_tokens_per_s",
    "perf/step_s",
    "perf/wait_s",
    "perf/forward_s",
    "perf/backward_s",
    "perf/publish_s",
    "loss/policy",
    "loss/kl",
    "policy/kl",
    "policy/entropy",
    "policy/clip_frac",
    "policy/iw_mean",
    "policy/iw_max",
]


def received_bytes(received: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {name: array.tobytes() for name, array in received.items()}


@pytest.mark.deepspeed
def test_learner_trains_publishes_checkpoints_survives_sigkill_and_resumes(tiny_model_dir, tmp_path: Path) -> None:
    config = process_config(
        tiny_model_dir,
        tmp_path,
        model__dtype="bfloat16",
        learner__lr=1e-2,
        learner__total_steps=5,
        learner__save_every=2,
    )
    checkpoints = tmp_path / "run" / "checkpoints"
    buffer = SyntheticBuffer(config.buffer.port, groups_per_step=2, group_size=4, gate=0, stale_at=3, flat_at=3)
    generator = Client(config.generator.weights_address, SocketSecurity(), identity="fake-generator", role="generator")
    try:
        with RoleUnderTest(config, "learner") as learner:
            learner.wait_until(lambda: any(r.step == 0 for r in buffer.requests), 120, "the first batch request")
            header, initial = fetch_weights(generator, -1)  # version 0 = the initial weights, served at once
            assert header.policy_version == 0
            assert received_bytes(initial) == safetensors_bytes(tiny_model_dir / "model.safetensors")
            buffer.set_gate(2, serve_held=True)  # the held request for step 0 is answered at once
            learner.wait_until(
                lambda: (checkpoints / "step-000002").is_dir() and any(r.step == 2 for r in buffer.requests),
                120,
                "checkpoint 2",
            )
            header, v2 = fetch_weights(generator, 0)
            assert header.policy_version == 2
            assert received_bytes(v2) == safetensors_bytes(checkpoints / "step-000002" / "hf" / "model.safetensors")
            assert sum(v2[n].tobytes() != initial[n].tobytes() for n in v2) == len(v2)  # every tensor trained
            # step 3 is trained and recorded, not checkpointed (save_every 2), when it dies
            buffer.set_gate(3, serve_held=True)
            learner.wait_until(lambda: any(r.step == 3 for r in buffer.requests), 120, "step 3's batch request")
            learner.kill()
            assert learner.poll() == -9
        assert [(r.policy_version, r.step) for r in buffer.reports] == [(0, 0), (1, 1), (2, 2), (3, 3)]
        before = len(buffer.requests), len(buffer.reports)
        buffer.set_gate(4)
        with RoleUnderTest(config, "learner", "--learner.resume", "true") as learner:
            learner.wait_until(
                lambda: (checkpoints / "step-000004").is_dir() and any(r.step == 4 for r in buffer.requests),
                120,
                "checkpoint 4",
            )
            assert buffer.requests[before[0]].step == 2  # continues where the checkpoint left off
            header, v4 = fetch_weights(generator, 2)
            assert header.policy_version == 4
            assert received_bytes(v4) == safetensors_bytes(checkpoints / "step-000004" / "hf" / "model.safetensors")
            assert fetch_weights(generator, 4)[0] == WeightsNotNewer(latest_version=4)
            buffer.set_gate(None, serve_held=True)
            assert learner.wait(120) == 0, learner.tail()
        assert [(r.policy_version, r.step) for r in buffer.reports[before[1] :]] == [(2, 2), (3, 3), (4, 4), (5, 5)]
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000004", "step-000005"]  # keep 2
        records = read_metrics(tmp_path / "run" / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # step 3 of the killed learner dropped at resume
        for key in REQUIRED_METRICS:
            assert all(r.get(key) is not None for r in records), key
        # the buffer dropped one group of 4 samples as too stale at step 3 (stale_at): its count reaches the metrics
        assert records[-1]["buffer/dropped_stale"] == 4 and records[-1]["policy_version"] == 5
        # and filtered one group of 4 samples of reward 1.0 at step 3 (flat_at): 4 samples, reward sum 4.0
        assert records[-1]["buffer/dropped_no_signal"] == 4 and records[-1]["buffer/no_signal_reward_sum"] == 4.0
        assert records[0]["buffer/dropped_no_signal"] == 0 and records[0]["buffer/no_signal_reward_sum"] == 0.0
    finally:
        generator.close()
        buffer.close()


@pytest.mark.integration
def test_simulated_learner_serves_real_bytes_and_real_versions(tmp_path: Path) -> None:
    config = process_config(
        "tiny",
        tmp_path,
        run__simulate=True,
        learner__sim_weights_mb=3.0,
        learner__sim_sample_s=0.05,
        learner__total_steps=3,
    )
    buffer = SyntheticBuffer(config.buffer.port, groups_per_step=2, group_size=4, gate=2)
    generator = Client(config.generator.weights_address, SocketSecurity(), identity="fake-generator", role="generator")
    try:
        with RoleUnderTest(config, "learner") as learner:
            learner.wait_until(lambda: any(r.step == 2 for r in buffer.requests), 60, "step 2's batch request")
            header, weights = fetch_weights(generator, -1)
            assert header.policy_version == 2
            assert sum(a.nbytes for a in weights.values()) == 3 << 20
            assert all(a[0] == 2.0 for a in weights.values())
            buffer.set_gate(None)
            assert learner.wait(60) == 0, learner.tail()
        assert [r.policy_version for r in buffer.reports] == [0, 1, 2, 3]
        records = read_metrics(tmp_path / "run" / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2, 3]
        assert records[0]["reward/mean"] > 0 and records[0]["perf/samples"] == 8
        assert not any(key.startswith("loss/") for key in records[0])  # nothing pretends to be a loss
        assert "deepspeed" not in learner.tail(100_000).lower()  # the simulation never starts DeepSpeed
        assert all(r["simulation"] is True for r in records)
        log_lines = (tmp_path / "run" / "logs" / "learner-0.log").read_text().splitlines()
        assert log_lines and all("[learner-0 SIMULATION]" in line for line in log_lines if line[:1].isdigit())
        # step 3 waited for the gate: its wall-clock rate is below the compute rate, which no wait can lower. The
        # inequalities are exact: a step's train_s lies within its step_s, which lies within the interval between
        # the two records (perf_counter readings in order, and rounded subtraction keeps their order)
        for r in records:
            assert r["perf/interval_s"] >= r["perf/step_s"] >= r["perf/train_s"]
            assert r["throughput/tokens_per_s"] == pytest.approx(r["perf/tokens"] / r["perf/interval_s"], rel=1e-12)
        assert records[2]["throughput/tokens_per_s"] < records[2]["perf/train_tokens_per_s"]
    finally:
        generator.close()
        buffer.close()


@pytest.mark.integration
def test_sigint_checkpoints_the_step_reached_and_the_resumed_run_records_each_step_once(tmp_path: Path) -> None:
    """The demo's save_every = 0: only the interrupt saves. SIGINT while the learner waits for step 3's batch: it
    exits 130 with the checkpoint of step 3; resumed, it trains steps 4 and 5 and ends the run (`final`)."""
    config = process_config(
        "tiny",
        tmp_path,
        run__simulate=True,
        learner__sim_weights_mb=1.0,
        learner__sim_sample_s=0.01,
        learner__total_steps=5,
        learner__save_every=0,
    )
    checkpoints = tmp_path / "run" / "checkpoints"
    buffer = SyntheticBuffer(config.buffer.port, groups_per_step=2, group_size=4, gate=3)
    try:
        with RoleUnderTest(config, "learner") as learner:
            learner.wait_until(lambda: any(r.step == 3 for r in buffer.requests), 60, "step 3's batch request")
            learner.send_signal(signal.SIGINT)
            assert learner.wait(60) == 130, learner.tail()
        assert [p.name for p in checkpoints.iterdir()] == ["step-000003"]
        assert "SIGINT at step 3/5: checkpoint" in learner.output()
        assert not any(r.final for r in buffer.reports)  # interrupted: the run is not over
        buffer.set_gate(None)
        before = len(buffer.requests)
        with RoleUnderTest(config, "learner", "--learner.resume", "true") as resumed:
            assert resumed.wait(60) == 0, resumed.tail()
        assert buffer.requests[before].step == 3  # continues at the saved step
        assert [(r.step, r.resync, r.final) for r in buffer.reports][-3:] == [
            (3, True, False),
            (4, False, False),
            (5, False, True),
        ]
        records = read_metrics(tmp_path / "run" / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    finally:
        buffer.close()


def test_simulated_trainer_costs_sim_sample_s_per_sample_over_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    config = learner_config(
        "tiny", run__simulate=True, learner__sim_sample_s=0.02, learner__sim_weights_mb=1.0, learner__world_size=2
    )
    trainer = SimulatedTrainer(config.learner, config.algo)
    groups = synthetic_batch(0, 4, 4)
    start = time.perf_counter()
    stats = trainer.train_step(groups, [np.ones(4, dtype=np.int32)] * 4)
    assert time.perf_counter() - start >= 0.16  # it really sleeps (a lower bound holds on any machine)
    assert stats["staleness/frac_1"] == 1.0 and stats["perf/samples"] == 16
    assert sum(np.prod(shape) * 4 for _, _, shape in trainer.weight_layout()) == 1 << 20
    assert all(array[0] == 1.0 for _, array in trainer.full_weights())
    # the cost it models, from the sleep it asks for rather than a wall clock that a loaded machine stretches
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    trainer.train_step(groups, [np.ones(4, dtype=np.int32)] * 4)
    assert slept == [pytest.approx(16 * 0.02 / 2)]  # 16 samples x 0.02 s / 2 ranks
