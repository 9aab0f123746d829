"""The generator's side of a broadcast round (actors/weights/transfer.py `BroadcastLoad`): which worker RPCs run, in
which order, when a group must be (re)joined, and whether a failure may have left the model on two versions. The
RPCs are recorded (vLLM's side runs in tests/actors/test_broadcast_vllm.py)."""

from __future__ import annotations

import pytest

from actors.weights.transfer import BroadcastLoad, GroupTicket
from common.weight_messages import TensorSpec, WeightsHeader

HEADER = WeightsHeader(
    policy_version=3, tensors=[TensorSpec("w", "float32", [2], 0, 0, 8)], bucket_sizes=[8], transport="broadcast"
)


def ticket(epoch: int) -> GroupTicket:
    return GroupTicket(epoch, "127.0.0.1", 29517, 3, 1, "gloo", 5.0, 5.0, False)


class Workers:
    """Records every RPC; raises at `fail` (a method name)."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[str] = []
        self.fail = fail

    def __call__(self, method: str, args: tuple = ()) -> list[None]:
        self.calls.append(method)
        if method == self.fail:
            raise RuntimeError(f"{method} failed in the worker")
        return [None]


def test_a_group_is_joined_once_per_epoch_and_left_for_the_next() -> None:
    workers = Workers()
    load = BroadcastLoad(workers)
    timings = load.run(ticket(0), HEADER)
    load.run(ticket(0), HEADER)
    load.run(ticket(1), HEADER)
    round_calls = ["start_weight_update", "update_weights", "finish_weight_update"]
    assert workers.calls == [
        "init_weight_transfer_engine",
        *round_calls,
        *round_calls,
        "shutdown_weight_transfer_engine",
        "init_weight_transfer_engine",
        *round_calls,
    ]
    assert timings["path"] == "broadcast" and not load.swapping


def test_a_round_that_fails_mid_transfer_may_leave_the_model_mixed_and_the_group_is_rejoined() -> None:
    load = BroadcastLoad(Workers(fail="update_weights"))
    with pytest.raises(RuntimeError, match="update_weights failed"):
        load.run(ticket(0), HEADER)
    assert load.swapping and load.epoch == -1  # some layers may be new; the next round joins afresh
    load.rpc = workers = Workers()
    load.run(ticket(0), HEADER)
    assert workers.calls[0] == "init_weight_transfer_engine" and not load.swapping


def test_a_group_that_cannot_be_joined_leaves_the_model_untouched() -> None:
    load = BroadcastLoad(Workers(fail="init_weight_transfer_engine"))
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine failed"):
        load.run(ticket(0), HEADER)
    assert not load.swapping and load.epoch == -1
