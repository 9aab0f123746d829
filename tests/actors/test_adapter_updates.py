"""Adapter-only weight updates (learner.lora.sync = "adapter"), the generator's checks: what the wire refuses in a
header's adapter settings (`WeightsHeader.validate`, a `ContractError` on decode), what `check_frames` refuses in an
adapter's tensors (`common.weights.check_adapter`, a `WeightsLayoutError`: the source makes it a counted bad reply),
the kind of update an engine takes (`check_update_kind`: `WeightsRejected`, counted by the poller), and the simulation
engine's version stamping with adapters (a request keeps the adapter it was added with)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import pytest

from actors.engine.simulated import SimEngine
from actors.weights.updates import WeightsPoller, WeightsRejected, WeightsUpdate, ZmqWeightsSource, check_update_kind
from common.sockets import SocketSecurity
from common.weight_messages import MAX_LORA_RANK, WeightsHeader
from common.weights import WeightsLayoutError, check_frames
from common.wire import WireError, decode, encode
from launch.testing import free_port, pack_weights
from tests.security.test_weights_attacks import ScriptedPublisher, fetch_until_loaded

RANK = 4
TARGETS = ["q_proj", "down_proj"]


def adapter_arrays(rank: int = RANK) -> dict[str, np.ndarray]:
    """The A/B matrices of a two-layer model's q_proj (64 -> 64) and down_proj (128 -> 64), peft's names without
    "base_model.model."."""
    arrays = {}
    for layer in range(2):
        for block, module, d_in in (("self_attn", "q_proj", 64), ("mlp", "down_proj", 128)):
            stem = f"model.layers.{layer}.{block}.{module}"
            arrays[f"{stem}.lora_A.weight"] = np.full((rank, d_in), 0.01, np.float32)
            arrays[f"{stem}.lora_B.weight"] = np.full((64, rank), 0.02, np.float32)
    return arrays


def adapter_update(version: int = 3, arrays: dict[str, np.ndarray] | None = None, **settings: Any):
    header, buckets = pack_weights(adapter_arrays() if arrays is None else arrays, version, 1 << 20)
    fields = {"lora_rank": RANK, "lora_alpha": 8.0, "lora_target_modules": TARGETS, **settings}
    return dataclasses.replace(header, **fields), buckets


def wire_round_trip(header: WeightsHeader) -> WeightsHeader:
    message, _ = decode([bytes(frame) for frame in encode(header)])
    return message


def test_an_adapter_header_crosses_the_wire_and_passes_the_checks() -> None:
    header, buckets = adapter_update()
    decoded = wire_round_trip(header)
    assert (decoded.lora_rank, decoded.lora_alpha, decoded.lora_target_modules) == (RANK, 8.0, TARGETS)
    assert len(check_frames(decoded, buckets)) == len(header.bucket_sizes)
    full, _ = pack_weights({"model.norm.weight": np.ones(64, np.float32)}, 1)
    assert wire_round_trip(full).lora_rank == 0  # a full update, as before


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lora_rank": -1}, r"lora_rank: -1 is outside"),
        ({"lora_rank": MAX_LORA_RANK + 1}, "lora_rank: 4097 is outside"),
        ({"lora_alpha": 0.0}, r"lora_alpha: 0.0 is outside \(0, "),
        ({"lora_alpha": -8.0}, "lora_alpha: -8.0 is outside"),
        ({"lora_target_modules": []}, "0 names"),
        ({"lora_target_modules": [f"m{i}" for i in range(65)]}, "65 names"),
        ({"lora_target_modules": ["q_proj", "q_proj"]}, "repeated"),
        ({"lora_target_modules": ["q_proj.weight"]}, "is not a module name"),  # a dotted path would match any name
        ({"lora_target_modules": ["q_proj|.*"]}, "is not a module name"),
        ({"lora_target_modules": ["q_pröj"]}, "is not a module name"),
        ({"lora_target_modules": ["a" * 101]}, "is not a module name"),
        ({"lora_rank": 0}, "set on a full update"),  # alpha and modules without a rank: a confused publisher
    ],
)
def test_adapter_settings_out_of_bounds_are_refused_on_decode(settings: dict, message: str) -> None:
    header, _ = adapter_update(**settings)
    with pytest.raises(WireError, match=message) as caught:
        wire_round_trip(header)
    assert caught.value.kind == "invalid_fields"  # the decoder's ContractError, as every bad field is


def renamed(arrays: dict[str, np.ndarray], old: str, new: str) -> dict[str, np.ndarray]:
    return {new if name == old else name: array for name, array in arrays.items()}


Q_A = "model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (renamed(adapter_arrays(), Q_A, "model.layers.0.self_attn.q_proj.weight"), "not a LoRA name"),  # a base weight
        (renamed(adapter_arrays(), Q_A, f"base_model.model.{Q_A}"), "not a LoRA name"),  # peft's prefix kept
        (renamed(adapter_arrays(), Q_A, "model.layers.0..q_proj.lora_A.weight"), "not a LoRA name"),
        (renamed(adapter_arrays(), Q_A, "model.layers.0.self_attn.q_proj.lora_A.weight "), "not a LoRA name"),
        (renamed(adapter_arrays(), Q_A, "model." * 60 + "q_proj.lora_A.weight"), "not a LoRA name"),  # 300+ chars
        (renamed(adapter_arrays(), Q_A, "model.layers.0.self_attn.k_proj.lora_A.weight"), "none of lora_target"),
        ({n: a for n, a in adapter_arrays().items() if n != Q_A}, "lacks its lora_A or lora_B"),
        ({**adapter_arrays(), Q_A: np.zeros((RANK + 1, 64), np.float32)}, r"not \[rank, in\] with rank 4"),
        ({**adapter_arrays(), Q_A: np.zeros((RANK, 64, 1), np.float32)}, r"not \[rank, in\]"),
        ({**adapter_arrays(), Q_A: np.zeros((RANK, 0), np.float32)}, r"not \[rank, in\]"),
        ({**adapter_arrays(), Q_A: np.zeros((RANK, 64), np.int32)}, "dtype 'int32' is none of"),
        ({}, "no tensors"),
    ],
)
def test_an_adapter_whose_tensors_are_not_lora_matrices_of_its_modules_is_refused(arrays, message: str) -> None:
    header, buckets = adapter_update(arrays=arrays)
    with pytest.raises(WeightsLayoutError, match=message):
        check_frames(header, buckets)


def test_the_rank_of_b_is_its_second_dim() -> None:
    name = "model.layers.1.mlp.down_proj.lora_B.weight"
    header, buckets = adapter_update(arrays={**adapter_arrays(), name: np.zeros((RANK, 64), np.float32)})
    with pytest.raises(WeightsLayoutError, match=r"shape \[4, 64\] is not \[out, rank\]"):
        check_frames(header, buckets)


def test_a_generator_counts_a_bad_adapter_then_loads_the_next_good_one() -> None:
    """Over a real socket: an adapter with a base weight among its tensors is a counted bad reply, never fatal."""
    bad_header, bad_buckets = adapter_update(arrays=renamed(adapter_arrays(), Q_A, "model.norm.weight"))
    header, buckets = adapter_update(version=4)
    server = ScriptedPublisher(free_port(), [(bad_header, bad_buckets), (header, buckets)], latest=4).start()
    source = ZmqWeightsSource(f"127.0.0.1:{server.port}", SocketSecurity(), generator_id=0, timeout_s=10)
    poller = WeightsPoller(source, poll_s=0.1, backoff_max_s=0.2)
    try:
        update = fetch_until_loaded(poller, have_version=0)
        assert update.policy_version == 4 and update.header.lora_target_modules == TARGETS
        assert poller.failures == {"bad_reply": 1}
    finally:
        poller.close()
        server.stop()


def received(header: WeightsHeader, buckets: list) -> WeightsUpdate:
    return WeightsUpdate(header, check_frames(header, buckets), time.monotonic())


def test_an_engine_takes_only_the_kind_of_update_it_serves() -> None:
    adapter = adapter_update()[0]
    full = pack_weights({"model.norm.weight": np.ones(64, np.float32)}, 3)[0]
    check_update_kind(adapter, max_lora_rank=RANK)
    check_update_kind(adapter, max_lora_rank=16)  # vLLM serves any rank up to its max_lora_rank
    check_update_kind(full, max_lora_rank=0)
    with pytest.raises(WeightsRejected, match="adapter-only update .* loads full weights"):
        check_update_kind(adapter, max_lora_rank=0)
    with pytest.raises(WeightsRejected, match="full-weights update .* serves LoRA adapters"):
        check_update_kind(full, max_lora_rank=RANK)
    with pytest.raises(WeightsRejected, match="adapter rank 4 is over this engine's 2"):
        check_update_kind(adapter, max_lora_rank=2)


def test_a_rejected_update_is_counted_and_asked_for_again_after_the_back_off() -> None:
    poller = WeightsPoller(source=None, poll_s=1.0, backoff_max_s=10.0)  # type: ignore[arg-type]  # never fetches
    engine = SimEngine(sim_tokens=4, sim_token_s=0.0, max_num_seqs=4, seed=0, lora_rank=RANK)
    update = received(*pack_weights({"model.norm.weight": np.ones(64, np.float32)}, 2))
    before = time.monotonic()
    with pytest.raises(WeightsRejected) as caught:
        engine.load_weights(update, inflight=False)
    poller.reject(update, caught.value)
    assert poller.failures == {"rejected_update": 1} and engine.policy_version == 0
    assert poller.next_poll > before  # not at once: after the back-off


def run_to_end(engine: SimEngine) -> dict[str, Any]:
    finished = {}
    while engine.num_unfinished():
        for sample in engine.step():
            finished[sample.request_id] = sample
    return finished


def test_with_adapters_a_request_keeps_the_version_it_was_added_with_inflight() -> None:
    """vLLM keeps a request's LoRARequest to its end, so each of its tokens comes from that adapter: the simulation
    stamps them so. Without adapters an inflight load restamps the later tokens (the weights changed under them)."""
    for lora_rank, later_versions in ((RANK, {0}), (0, {0, 5})):
        engine = SimEngine(sim_tokens=6, sim_token_s=0.0, max_num_seqs=4, seed=0, lora_rank=lora_rank)
        engine.add("old", [1, 2, 3])
        engine.step()
        engine.step()
        header, buckets = adapter_update(version=5) if lora_rank else pack_weights({"w": np.ones(4, np.float32)}, 5)
        engine.load_weights(received(header, buckets), inflight=True)
        engine.add("new", [1, 2, 3])
        finished = run_to_end(engine)
        assert set(finished["old"].token_versions.tolist()) == later_versions
        assert finished["old"].token_versions[:2].tolist() == [0, 0] and finished["old"].start_version == 0
        assert set(finished["new"].token_versions.tolist()) == {5} and finished["new"].start_version == 5
