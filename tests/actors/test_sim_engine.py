"""The SIMULATION engine (actors/engine/simulated.py): continuous batching at a fixed cost per step."""

from __future__ import annotations

import time

import numpy as np
import pytest

from actors.engine.api import EVAL_PRIORITY, TRAINING_PRIORITY
from actors.engine.simulated import SimEngine
from actors.weights.updates import WeightsUpdate
from launch.testing import pack_weights


def _update(version: int) -> WeightsUpdate:
    header, buckets = pack_weights({"w": np.zeros(4, np.float32)}, version)
    return WeightsUpdate(header, [memoryview(b) for b in buckets], time.monotonic())


def _run_to_end(engine: SimEngine) -> list:
    finished = []
    while engine.num_unfinished():
        finished.extend(engine.step())
    return finished


def test_a_step_costs_the_same_whatever_the_batch(monkeypatch):
    engine = SimEngine(sim_tokens=10, sim_token_s=0.01, max_num_seqs=64, seed=0)
    engine.add("real", [1, 2])
    start = time.monotonic()
    _run_to_end(engine)
    assert time.monotonic() - start >= 0.1 - 1e-3  # it really sleeps: 10 steps of 0.01 s (a lower bound holds anywhere)
    # what each step costs, read from the sleeps it asks for, not from a wall clock that a loaded machine stretches
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    for batch in (1, 32):
        slept.clear()
        for i in range(batch):
            engine.add(f"{batch}:{i}", [1, 2])
        finished = _run_to_end(engine)
        assert len(finished) == batch
        assert all(len(s.completion_tokens) == 10 and s.finish_reason == "length" for s in finished)
        assert slept == [0.01] * 10, (batch, slept)  # 10 steps of 0.01 s, batch or not


def test_requests_join_the_running_batch_and_respect_max_num_seqs():
    engine = SimEngine(sim_tokens=4, sim_token_s=0.0, max_num_seqs=2, seed=0)
    for i in range(3):
        engine.add(f"r{i}", [1])
    engine.step()
    assert len(engine.running) == 2 and len(engine.waiting) == 1
    engine.step()
    engine.add("late", [1])
    finished = {s.request_id: s for s in _run_to_end(engine)}
    assert set(finished) == {"r0", "r1", "r2", "late"}
    sample = finished["r0"]
    assert sample.completion_tokens.dtype == np.int32 and np.all(sample.behaviour_logprobs <= 0)


def test_inflight_load_stamps_later_tokens_with_the_new_version():
    engine = SimEngine(sim_tokens=6, sim_token_s=0.0, max_num_seqs=8, seed=0)
    engine.add("a", [1])
    engine.step()
    engine.step()
    with pytest.raises(RuntimeError, match="samples running"):
        engine.load_weights(_update(1), inflight=False)
    engine.load_weights(_update(1), inflight=True)
    engine.add("b", [1])
    finished = {s.request_id: s for s in _run_to_end(engine)}
    assert finished["a"].token_versions.tolist() == [0, 0, 1, 1, 1, 1] and finished["a"].start_version == 0
    assert finished["b"].token_versions.tolist() == [1] * 6 and finished["b"].start_version == 1
    engine.load_weights(_update(2), inflight=False)
    assert engine.policy_version == 2


def test_abort_drops_requests():
    engine = SimEngine(sim_tokens=3, sim_token_s=0.0, max_num_seqs=1, seed=0)
    engine.add("run", [1])
    engine.add("wait", [1])
    engine.step()
    engine.abort(["run", "wait", "unknown"])
    assert engine.num_unfinished() == 0 and engine.step() == []


def test_a_free_slot_goes_to_the_lowest_priority_first_in_arrival_order():
    """As vLLM's priority scheduler: evaluation (EVAL_PRIORITY) queued before training still waits for it."""
    engine = SimEngine(sim_tokens=1, sim_token_s=0.0, max_num_seqs=2, seed=0)
    for i in range(3):
        engine.add(f"eval-{i}", [1], priority=EVAL_PRIORITY)
    engine.add("train-0", [1])
    engine.add("train-1", [1], priority=TRAINING_PRIORITY)
    order = [[s.request_id for s in engine.step()] for _ in range(3)]
    assert order == [["train-0", "train-1"], ["eval-0", "eval-1"], ["eval-2"]]
    assert engine.num_unfinished() == 0
