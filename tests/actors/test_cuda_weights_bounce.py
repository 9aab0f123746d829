"""actors/cuda_weights.BounceCopier on CPU (review finding 4): bytes reach their targets bit-exact through two
small buffers, in pieces that straddle tensors and buffers, and a buffer is written again only after the device
has read it (the marker recorded when it was handed over is waited on first). On CUDA the same code runs with
pinned buffers and events (benchmarks/gpu_check.py)."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from actors.weights.cuda import BounceCopier, PinnedFile, device_copies
from actors.weights.updates import SharedMemoryStaging, WeightsUpdate
from launch.testing import pack_weights


class Marker:
    """An event stand-in: logs when it is recorded and waited on."""

    def __init__(self, log: list[str], number: int) -> None:
        self.log, self.number = log, number
        log.append(f"record {number}")

    def synchronize(self) -> None:
        self.log.append(f"sync {self.number}")


def test_pieces_straddle_tensors_and_buffers_bit_exact_and_a_buffer_is_reused_only_once_read() -> None:
    gen = torch.Generator().manual_seed(0)
    sizes = [5, 16, 40, 0, 3, 1]  # 65 bytes through 2 x 16: buffer fills of 16, 16, 16, 16, 1
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    targets = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    buffers = [torch.zeros(16, dtype=torch.uint8) for _ in range(2)]
    log: list[str] = []
    numbers = itertools.count()
    copier = BounceCopier(buffers, "cpu", record_event=lambda: Marker(log, next(numbers)))
    for source, target in zip(sources, targets, strict=True):
        copier.copy(source, target)
    for source, target in zip(sources, targets, strict=True):
        assert torch.equal(source, target)
    # buffer 0 handed over (marker 0), 1 handed over (1), 0 taken again after marker 0, and so on
    assert log == ["record 0", "record 1", "sync 0", "record 2", "sync 1", "record 3", "sync 2"]
    stream = torch.cat(sources)
    assert torch.equal(buffers[0][:1], stream[64:]) and torch.equal(buffers[1], stream[48:64])  # the last fills


def test_a_staged_file_loads_bit_exact_through_bounce_buffers(tmp_path) -> None:
    rng = np.random.default_rng(1)
    arrays = {
        "model.embed_tokens.weight": rng.standard_normal((50, 8), dtype=np.float32),  # 1600 bytes: many pieces
        "model.norm.weight": rng.standard_normal(8, dtype=np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.integers(0, 2**16, (16, 8), dtype=np.uint16),
    }
    header, buckets = pack_weights(
        arrays, 3, bucket_bytes=1024, dtypes={"model.layers.0.mlp.up_proj.weight": "bfloat16"}
    )
    staging = SharedMemoryStaging(tmp_path)
    try:
        tensors = staging.write(WeightsUpdate(header, [memoryview(b) for b in buckets], 0.0))
        with PinnedFile(str(staging.path), "cpu") as staged:
            assert staged.path == "pageable"  # on CPU by default
            staged.bounce = BounceCopier([torch.empty(96, dtype=torch.uint8) for _ in range(2)], "cpu")
            assert staged.path == "bounce"
            loaded = {name: tensor.clone() for name, tensor in device_copies(staged, tensors)}
    finally:
        staging.close()
    assert loaded["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    for name, array in arrays.items():
        got = loaded[name].view(torch.uint16) if array.dtype == np.uint16 else loaded[name]
        assert np.array_equal(got.numpy(), array), name
