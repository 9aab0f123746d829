"""A generator of a run with learner.lora.sync = "adapter", end to end with the SIMULATION engine (no vLLM): it takes
adapter-only updates, counts a full-weights update as a rejected one and goes on (never fatal), and its samples carry
the adapter's version. A real `tandem generator` subprocess against a fake buffer and a fake publisher on loopback
(tests/actors/test_generator_sim.py's rig)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from common.metrics import read_metrics
from common.types import LeaseRefused
from launch.testing import FakeBuffer, FakePublisher, arithmetic_items, pack_weights, run_config
from tests.actors.test_adapter_updates import RANK, TARGETS, adapter_arrays
from tests.actors.test_generator_sim import GROUP_SIZE, REWARD_FN, _finish, _start

pytestmark = pytest.mark.integration  # starts role processes


def _publish_adapter(publisher: FakePublisher, version: int) -> None:
    header, buckets = pack_weights(adapter_arrays(), version, publisher.bucket_bytes)
    header = dataclasses.replace(header, lora_rank=RANK, lora_alpha=8.0, lora_target_modules=TARGETS)
    with publisher.lock:
        publisher.latest, publisher.version = (header, buckets), version


def test_an_adapter_generator_refuses_full_weights_then_samples_with_the_adapter(tmp_path, ports):
    config = run_config(
        tmp_path / "runs",
        "gen",
        ports=ports,
        run={"simulate": True},
        algo={"group_size": GROUP_SIZE},
        env={"failure_reward": -1.0, "reward_fn": REWARD_FN},
        generator={"sim_tokens": 6, "sim_token_s": 0.002, "prompts_in_flight": 4, "reconnect_max_s": 0.5},
        learner={"lora.rank": RANK, "lora.sync": "adapter", "lora.target_modules": TARGETS},
    )
    buffer = FakeBuffer(config, arithmetic_items(4), lease_size=2)
    with buffer, FakePublisher(ports[1]) as publisher:
        buffer.refusal = lambda request: None if request.policy_version >= 2 else LeaseRefused("stale", 2, 0.1)
        publisher.publish(1, {"w": np.ones(8, np.float32)})  # full weights: this generator serves adapters only
        process = _start(config)
        try:
            process.wait_until(lambda: "rejected_update" in process.output(), 60, "the full update rejected")
            assert not buffer.leases  # still at v0: refused as stale
            _publish_adapter(publisher, 2)
            code, err = _finish(process, timeout_s=60)
        finally:
            process.kill()
    assert code == 0, err[-3000:]
    assert "full-weights update and this engine serves LoRA adapters only" in err
    groups = buffer.wait_for_groups(4, timeout_s=1)
    assert groups and all((g.token_versions == 2).all() and (g.versions == 2).all() for g in groups)
    records = read_metrics(tmp_path / "runs" / "gen" / "generator-0.jsonl")
    assert records[-1]["actor/weight_fetch_failures"] >= 1
