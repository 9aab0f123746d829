"""The weights layout shared by the learner's publisher and the generator's receiver (common/weights.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.weight_messages import WeightsHeader
from common.weights import (
    ALIGN,
    WeightsLayoutError,
    plan_buckets,
    room_for,
    shared_memory_dir,
    weights_store_dir,
    weights_store_dirs,
)
from common.wire import decode, encode
from launch.testing import pack_weights, unpack_weights
from tests.shm_fakes import small_shared_memory

DTYPES = ["float32", "float16", "int64", "uint8", "bfloat16"]


def _random_array(rng: np.random.Generator, dtype_name: str, shape: tuple[int, ...]) -> np.ndarray:
    storage = np.uint16 if dtype_name == "bfloat16" else np.dtype(dtype_name)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(storage).itemsize, dtype=np.uint8)
    return raw.view(storage).reshape(shape)


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=3), min_size=1, max_size=12),
    dtype_index=st.lists(st.integers(0, len(DTYPES) - 1), min_size=12, max_size=12),
    bucket_bytes=st.integers(1, 4096),
)
def test_round_trip_is_exact_and_buckets_respect_the_limit(shapes, dtype_index, bucket_bytes):
    rng = np.random.default_rng(0)
    arrays, dtypes = {}, {}
    for i, shape in enumerate(shapes):
        dtype_name = DTYPES[dtype_index[i]]
        arrays[f"layer{i}.w"] = _random_array(rng, dtype_name, tuple(shape))
        dtypes[f"layer{i}.w"] = dtype_name
    header, buckets = pack_weights(arrays, policy_version=7, bucket_bytes=bucket_bytes, dtypes=dtypes)
    header.validate()
    assert [len(b) for b in buckets] == header.bucket_sizes
    assert all(spec.offset % ALIGN == 0 for spec in header.tensors)
    for bucket, size in enumerate(header.bucket_sizes):
        held = [s.nbytes for s in header.tensors if s.bucket == bucket and s.nbytes > 0]
        # a bucket exceeds the limit only when it holds a single tensor larger than the limit
        assert size <= bucket_bytes or (len(held) == 1 and held[0] > bucket_bytes)
    out = {spec.name: (spec, view) for spec, view in unpack_weights(header, buckets)}
    assert list(out) == list(arrays)  # order is the publisher's order
    for name, array in arrays.items():
        spec, view = out[name]
        assert spec.dtype == dtypes[name] and tuple(spec.shape) == array.shape
        assert view.dtype == array.dtype and view.shape == array.shape
        np.testing.assert_array_equal(view, array)


def test_buckets_are_filled_greedily_in_order():
    specs, sizes = plan_buckets([("a", "float32", [10]), ("b", "float32", [10]), ("c", "float32", [40])], 100)
    # a: 40 bytes at 0; b: aligned to 64, 64 + 40 = 104 > 100 -> new bucket; c: 160 bytes > 100 -> alone
    assert [(s.bucket, s.offset, s.nbytes) for s in specs] == [(0, 0, 40), (1, 0, 40), (2, 0, 160)]
    assert sizes == [40, 40, 160]
    specs, sizes = plan_buckets([("a", "bfloat16", [8]), ("b", "bfloat16", [8])], 1 << 20)
    assert [(s.bucket, s.offset) for s in specs] == [(0, 0), (0, 64)] and sizes == [80]


def test_views_are_zero_copy_over_received_frames():
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    header, buckets = pack_weights(arrays, policy_version=1)
    ((_spec, view),) = unpack_weights(header, buckets)
    buckets[0][0:4] = np.float32(99).tobytes()
    assert view[0, 0] == 99  # the view reads the bucket's memory


def test_header_and_buckets_travel_through_the_wire():
    rng = np.random.default_rng(1)
    arrays = {"emb": _random_array(rng, "bfloat16", (50, 8)), "norm": rng.standard_normal(8).astype(np.float32)}
    header, buckets = pack_weights(arrays, 3, bucket_bytes=512, dtypes={"emb": "bfloat16"})
    message, payload = decode(encode(header, buckets))
    assert isinstance(message, WeightsHeader) and message.policy_version == 3
    got = {spec.name: view for spec, view in unpack_weights(message, payload)}
    np.testing.assert_array_equal(got["emb"], arrays["emb"])
    np.testing.assert_array_equal(got["norm"], arrays["norm"])


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="C-contiguous"):
        pack_weights({"w": np.zeros((4, 4), np.float32).T[:, ::2]}, 0)
    with pytest.raises(ValueError, match="2-byte items"):
        pack_weights({"w": np.zeros(4, np.float32)}, 0, dtypes={"w": "bfloat16"})
    with pytest.raises(ValueError, match="not supported"):
        pack_weights({"w": np.zeros(4, np.float32)}, 0, dtypes={"w": "float8"})
    header, buckets = pack_weights({"w": np.zeros(4, np.float32)}, 0)
    with pytest.raises(WeightsLayoutError, match="1 buckets, 2 frames"):
        list(unpack_weights(header, [*buckets, b"x"]))
    with pytest.raises(WeightsLayoutError, match="header says 16"):
        list(unpack_weights(header, [bytes(15)]))


def test_a_shared_memory_too_small_falls_back_to_disk_saying_so_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    shm, tmp = small_shared_memory(monkeypatch, tmp_path, free_bytes=64 << 20)  # docker's default --shm-size
    assert shared_memory_dir(32 << 20) == shm and shared_memory_dir() == shm
    with caplog.at_level("WARNING", logger="tandem.common.weights"):
        assert shared_memory_dir(3 << 30) == tmp
        assert room_for(shm / "store", 3 << 30) == tmp / "store"
        assert room_for(shm / "store", 3 << 30, held_bytes=3 << 30) == shm / "store"  # its own files are room
    said = [record.getMessage() for record in caplog.records]
    assert len(said) == 2 and "64 MiB free for 3072 MiB" in said[0] and "docker run --shm-size=4g" in said[0]
    store = weights_store_dir(tmp_path / "run", need_bytes=3 << 30)
    assert store.parent == tmp and weights_store_dirs(tmp_path / "run") == [shm / store.name, store]
    with pytest.raises(OSError, match="--shm-size"):  # no room anywhere: refused, never written into (SIGBUS)
        room_for(shm, 1 << 60)
    with pytest.raises(OSError, match="free space there"):  # a folder that is not shared memory: no fallback
        room_for(tmp, 1 << 60)
