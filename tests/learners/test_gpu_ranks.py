"""The learner's collectives and device binding as they run on GPUs, checked on CPU (review findings 1 and 2).

NCCL has no CPU backend: every tensor that reaches a collective must be on this rank's GPU. No GPU here, so the
CUDA tensors are torch's fake tensors (metadata only), and the collective is a stand-in that refuses what NCCL
refuses. The device binding is checked by recording the calls torch and DeepSpeed receive.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import learners.engine as eng

GPU = torch.device("cuda", 1)  # this rank's device: not cuda:0, so a tensor left on the default GPU is caught too


@pytest.fixture
def nccl_world(monkeypatch):
    """Two ranks on NCCL: `all_reduce` reaches a collective that, like NCCL, takes tensors on this rank's GPU only
    ("No backend type associated with device type cpu"). Returns the devices the collective saw."""
    import deepspeed.comm as dist

    seen: list[torch.device] = []

    def nccl_all_reduce(tensor, op=None):
        seen.append(tensor.device)
        if tensor.device != GPU:
            raise RuntimeError(f"No backend type associated with device type {tensor.device.type}")
        return tensor

    monkeypatch.setattr(eng, "world_size", lambda: 2)
    monkeypatch.setattr(eng, "device", lambda: GPU)
    monkeypatch.setattr(dist, "all_reduce", nccl_all_reduce)
    return seen


def test_host_tensors_are_reduced_on_the_ranks_gpu(nccl_world) -> None:
    with FakeTensorMode(allow_non_fake_inputs=True):
        host = torch.zeros(3, dtype=torch.float64)  # what Trainer._sum_ranks builds from numpy
        on_gpu = torch.zeros(1, device=GPU)
        assert eng.all_reduce(host, "sum") is host and host.device.type == "cpu"
        assert eng.all_reduce(on_gpu, "max") is on_gpu
    assert nccl_world == [GPU, GPU]


def test_a_reduced_host_tensor_gets_the_collectives_result(monkeypatch) -> None:
    """The copy back: a stand-in collective on the CPU 'device' doubles (two equal ranks); the caller's tensor,
    which lives elsewhere (a float64 numpy-backed tensor, staged to float64 on the device), holds the sum."""
    import deepspeed.comm as dist

    def two_equal_ranks(tensor, op=None):
        assert tensor.dtype == torch.float64
        tensor.mul_(2)

    monkeypatch.setattr(eng, "world_size", lambda: 2)
    monkeypatch.setattr(eng, "device", lambda: torch.device("meta"))  # elsewhere than the tensor
    monkeypatch.setattr(dist, "all_reduce", two_equal_ranks)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, target: self.clone())  # the 'device' copy
    values = torch.from_numpy(np.array([1.0, 2.5]))
    eng.all_reduce(values, "sum")
    assert values.tolist() == [2.0, 5.0]


@pytest.fixture
def calls(monkeypatch):
    """Records torch.cuda.set_device and deepspeed.init_distributed, in order, on a 'machine' with 2 GPUs."""
    import deepspeed

    order: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: order.append(("set_device", index)))
    monkeypatch.setattr(
        deepspeed, "init_distributed", lambda dist_backend, verbose: order.append(("init", dist_backend))
    )
    return order


def test_each_rank_binds_its_local_gpu_before_the_group_forms(monkeypatch, calls) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    info = eng.init_distributed()
    assert calls == [("set_device", 1), ("init", "nccl")]
    assert (info.rank, info.world_size, info.local_rank) == (3, 4, 1)


def test_a_rank_whose_gpu_is_not_visible_is_refused_with_the_fix(monkeypatch, calls) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(
        ValueError, match=r"LOCAL_RANK 2 needs GPU 2, and this process sees 2 \(CUDA_VISIBLE_DEVICES=4,5"
    ):
        eng.init_distributed()
    assert calls == []
