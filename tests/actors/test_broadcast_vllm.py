"""The broadcast transport inside vLLM's workers, through vLLM 0.32's weight-transfer API (actors/weights/transfer.py):
a real CPU engine started with `weight_transfer_config` (Tandem's registered backend), a real publisher (gloo) in
this process, and rounds taken by `VllmEngine.load_weights`: the worker joins the group as its own rank
(`init_weight_transfer_engine`), receives each bucket and loads it by vLLM's layerwise reload (`start_weight_update`,
`update_weights`, `finish_weight_update`). After the round the engine samples as a fresh engine started on the new
weights (greedy tokens; the tiny model ties its output layer to the embedding, which the round must carry over).
A second round reuses the group (same epoch)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.actors.greedy_engine import engine as _engine
from tests.actors.greedy_engine import greedy as _greedy
from tests.actors.test_engine_load import _start_fresh_engine

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


def _checkpoint(model_dir: Path) -> list[tuple[str, object]]:
    from safetensors.torch import load_file

    return list(load_file(str(model_dir / "model.safetensors")).items())


def test_a_broadcast_round_loads_in_the_workers_as_a_fresh_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    import json

    from actors.weights.broadcast_source import BroadcastRound, open_broadcast_source
    from common.config import WeightsConfig
    from common.model_prep import make_tiny_model
    from common.sockets import SocketSecurity
    from launch.testing import free_port
    from learners.broadcast_publisher import BroadcastWeightsPublisher

    new_dir = make_tiny_model(tmp_path / "seed1", seed=1)
    out = tmp_path / "fresh.json"
    fresh_engine = _start_fresh_engine(new_dir, out)
    doorbell = free_port()
    weights = WeightsConfig(transport="broadcast", broadcast_backend="gloo", broadcast_port=free_port())
    publisher = BroadcastWeightsPublisher("127.0.0.1", doorbell, SocketSecurity(), weights)
    source = open_broadcast_source(weights, f"127.0.0.1:{doorbell}", SocketSecurity(), generator_id=0)
    try:
        engine = _engine(tiny_model_dir, broadcast=True)  # as the fresh one, with the weight-transfer API on
        try:
            before = _greedy(engine)
            for version, model_dir in ((1, new_dir), (2, new_dir)):
                tensors = _checkpoint(model_dir)
                layout = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors]
                publisher.publish(version, layout, iter(tensors))
                deadline = time.monotonic() + 30
                while not isinstance(update := source.fetch(version - 1), BroadcastRound):
                    assert time.monotonic() < deadline, "the round was never announced"
                    time.sleep(0.05)
                engine.load_weights(update, inflight=False)
                assert engine.last_load_path == "broadcast" and engine.policy_version == version
            after = _greedy(engine)
        finally:
            engine.shutdown()
        fresh_engine.wait(timeout=300)
    finally:
        source.close()
        publisher.close()
        if fresh_engine.poll() is None:
            os.killpg(fresh_engine.pid, signal.SIGKILL)
            fresh_engine.wait()
    assert fresh_engine.returncode == 0, Path(f"{out}.log").read_text()[-3000:]
    fresh = [tokens for tokens, _ in json.loads(out.read_text())]
    assert [t for t, _ in before] != fresh, "the two models must sample differently to tell them apart"
    assert [t for t, _ in after] == fresh
    assert publisher.counters["rounds"] == 2 and publisher.counters["epochs"] == 1  # one group, kept
