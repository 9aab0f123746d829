"""actors/cuda_weights on CPU: the host-staged load reads every tensor from the staged file, hands a tied model
the new embedding as its head, and reports where the time went; the CUDA parts (pinning, IPC) run only on a GPU
(benchmarks/gpu_check.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from actors.weights.cuda import load_staged_pinned
from actors.weights.updates import SharedMemoryStaging, WeightsUpdate
from launch.testing import pack_weights


class FakeRunner:
    """What `load_staged_pinned` uses of vLLM's GPU model runner: its device, hf_config and reload_weights."""

    def __init__(self, tied: bool) -> None:
        self.device = torch.device("cpu")
        self.model_config = SimpleNamespace(hf_config=SimpleNamespace(tie_word_embeddings=tied))
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def reload_weights(self, weights_iterator) -> None:
        self.loaded = [(name, tensor.clone()) for name, tensor in weights_iterator]


def test_the_staged_load_reads_every_tensor_and_gives_a_tied_model_its_head(tmp_path) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "model.embed_tokens.weight": rng.standard_normal((50, 8), dtype=np.float32),
        "model.norm.weight": rng.standard_normal(8, dtype=np.float32),
        "model.layers.0.mlp.up_proj.weight": rng.integers(0, 2**16, (16, 8), dtype=np.uint16),
    }
    header, buckets = pack_weights(
        arrays, 3, bucket_bytes=1024, dtypes={"model.layers.0.mlp.up_proj.weight": "bfloat16"}
    )
    staging = SharedMemoryStaging(tmp_path)
    try:
        tensors = staging.write(WeightsUpdate(header, [memoryview(b) for b in buckets], 0.0))
        runner = FakeRunner(tied=True)
        report = load_staged_pinned(runner, str(staging.path), tensors)
    finally:
        staging.close()
    assert report["path"] == "pageable" and report["map_s"] >= 0 and report["load_s"] >= 0  # nothing pinned on CPU
    names = [name for name, _ in runner.loaded]
    assert names == [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]
    loaded = dict(runner.loaded)
    assert loaded["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    for name, array in arrays.items():
        got = loaded[name].view(torch.uint16) if array.dtype == np.uint16 else loaded[name]
        assert np.array_equal(got.numpy(), array), name
    assert torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])
