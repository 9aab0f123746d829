"""What a generator refuses in a weights header before it indexes a byte with it (common.weights.check_frames, used
by actors.weights.updates.ZmqWeightsSource): each malformed header is a `WeightsLayoutError`, never another exception."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from actors.weights.updates import WeightsTransportError, ZmqWeightsSource
from common.sockets import SocketSecurity
from common.weight_messages import TensorSpec, WeightsHeader
from common.weights import MAX_POLICY_VERSION, WeightsLayoutError, check_frames
from launch.testing import FakePublisher, free_port, pack_weights

ARRAYS = {
    "model.embed_tokens.weight": np.arange(6 * 40, dtype=np.uint16).reshape(6, 40),
    "model.norm.weight": np.linspace(-1, 1, 40, dtype=np.float32),
}
DTYPES = {"model.embed_tokens.weight": "bfloat16"}


@pytest.fixture(scope="module")
def update() -> tuple[WeightsHeader, list[bytearray]]:
    return pack_weights(ARRAYS, 5, bucket_bytes=1 << 20, dtypes=DTYPES)  # one bucket: both tensors share it


def changed(header: WeightsHeader, index: int = 1, **fields: Any) -> WeightsHeader:
    specs = list(header.tensors)
    spec = specs[index]
    values = {name: getattr(spec, name) for name in ("name", "dtype", "shape", "bucket", "offset", "nbytes")}
    specs[index] = TensorSpec(**{**values, **fields})
    return WeightsHeader(header.policy_version, specs, header.bucket_sizes)


def test_the_published_layout_passes(update) -> None:
    header, buckets = update
    views = check_frames(header, buckets)
    assert [v.nbytes for v in views] == header.bucket_sizes


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dtype": "complex512"}, "dtype 'complex512' is none of"),
        ({"dtype": "__class__"}, "is none of"),  # a name the receiver would look up with getattr(torch, ...)
        ({"name": ""}, "non-empty and unique"),
        ({"name": "model.embed_tokens.weight"}, "non-empty and unique"),
        ({"shape": [-40], "nbytes": 160}, "non-negative"),
        ({"shape": [-2, -20]}, "non-negative"),  # product 40 matches the bytes: the sign alone is wrong
        ({"shape": [1] * 9, "nbytes": 4}, "<= 8"),
        ({"shape": [41]}, "nbytes 160 != shape"),
        ({"shape": [2**62, 2**62], "nbytes": 0}, "nbytes 0 != shape"),  # no int64 wrap-around
        ({"bucket": 1}, "bucket 1 out of range"),
        ({"bucket": -1}, "bucket -1 out of range"),
        ({"offset": 4}, "unaligned"),
        ({"offset": -64}, "unaligned or bytes outside"),
        ({"shape": [80], "nbytes": 320}, "outside bucket"),
        ({"offset": 0}, "overlap"),
    ],
)
def test_a_malformed_tensor_spec_is_refused(update, fields: dict, message: str) -> None:
    header, buckets = update
    with pytest.raises(WeightsLayoutError, match=message):
        check_frames(changed(header, **fields), buckets)


@pytest.mark.parametrize("version", [-1, MAX_POLICY_VERSION + 1])
def test_a_version_no_rollout_can_carry_is_refused(update, version: int) -> None:
    header, buckets = update
    with pytest.raises(WeightsLayoutError, match="outside"):
        check_frames(WeightsHeader(version, header.tensors, header.bucket_sizes), buckets)


def test_frames_that_disagree_with_the_header_are_refused(update) -> None:
    header, buckets = update
    with pytest.raises(WeightsLayoutError, match="1 buckets, 2 frames"):
        check_frames(header, [*buckets, b""])
    with pytest.raises(WeightsLayoutError, match="bytes arrived"):
        check_frames(header, [bytes(buckets[0])[:-1]])


def test_an_update_that_changes_the_model_layout_is_refused() -> None:
    publisher = FakePublisher(free_port()).start()
    source = ZmqWeightsSource(f"127.0.0.1:{publisher.port}", SocketSecurity(), generator_id=0, timeout_s=5)
    try:
        publisher.publish(1, ARRAYS, DTYPES)
        assert source.fetch(0).policy_version == 1
        publisher.publish(2, {**ARRAYS, "model.norm.weight": np.zeros(41, np.float32)}, DTYPES)
        with pytest.raises(WeightsTransportError, match=r"changes the model's layout \(model.norm.weight\)"):
            source.fetch(1)
        publisher.publish(3, ARRAYS, DTYPES)
        assert source.fetch(1).policy_version == 3  # the same layout again: accepted
    finally:
        source.close()
        publisher.stop()


def test_the_same_model_in_another_float_dtype_is_accepted_another_kind_is_not() -> None:
    """model.dtype = "auto" chooses per machine: a learner restarted elsewhere publishes the same model in another
    float dtype, which the engine casts into its own (actors/engine/vllm.py); an integer tensor is another layout."""
    publisher = FakePublisher(free_port()).start()
    source = ZmqWeightsSource(f"127.0.0.1:{publisher.port}", SocketSecurity(), generator_id=0, timeout_s=5)
    as_float32 = {**ARRAYS, "model.embed_tokens.weight": ARRAYS["model.embed_tokens.weight"].astype(np.float32)}
    try:
        publisher.publish(1, ARRAYS, DTYPES)
        assert source.fetch(0).policy_version == 1
        publisher.publish(2, as_float32, {})  # bfloat16 -> float32
        update = source.fetch(1)
        assert update.policy_version == 2 and [s.dtype for s in update.header.tensors] == ["float32", "float32"]
        publisher.publish(3, {**ARRAYS, "model.norm.weight": np.zeros(40, np.int32)}, DTYPES)
        with pytest.raises(WeightsTransportError, match=r"changes the model's layout \(model.norm.weight\)"):
            source.fetch(2)
    finally:
        source.close()
        publisher.stop()
