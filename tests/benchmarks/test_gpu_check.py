"""benchmarks/gpu_check on a machine without CUDA: it says so and writes nothing; its host-staged update and its
headline run here on CPU (the pinned registration and CUDA IPC only run on a GPU)."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import gpu_check

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")


@needs_no_cuda
def test_without_cuda_it_says_so_and_writes_nothing(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["gpu_check", "--out", str(tmp_path / "out")])
    monkeypatch.setattr("benchmarks.common.RESULTS", tmp_path / "results")
    gpu_check.main()
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "results").exists() and not (tmp_path / "out").exists()


def test_the_host_staged_update_delivers_every_byte_on_cpu(monkeypatch) -> None:
    monkeypatch.setattr(gpu_check, "DEVICE", "cpu")
    learner, receiver = gpu_check.llama(gpu_check.SMALL, seed=1), gpu_check.llama(gpu_check.SMALL, seed=2)
    weights = gpu_check.named_weights(learner)
    assert gpu_check.checksum(gpu_check.named_weights(receiver)) != gpu_check.checksum(weights)
    update = gpu_check.host_staged_update(weights, receiver, repeats=2)
    assert update["pinned"] is False  # nothing to pin on CPU
    assert update["bytes"] == sum(t.numel() * 2 for _, t in weights)  # bfloat16: 2 bytes a parameter
    for (name, sent), (_, got) in zip(weights, gpu_check.named_weights(receiver), strict=True):
        assert torch.equal(sent.view(torch.int16), got.view(torch.int16)), name


def test_the_headline_is_made_from_the_figures() -> None:
    large = {
        "bytes": 2_000_000_000,
        "d2d_copy_s": 0.001,
        "host_staged": {"update_s": 0.5},
        "ipc": {"update_s": 0.002},
    }
    result = {"checks": {"a": {"ok": True}, "b": {"ok": True}}, "large": large}
    headline = gpu_check.headline(result)
    assert headline["all_ok"] and headline["d2d_gb_s"] == pytest.approx(2000.0)
    assert headline["host_staged_over_d2d"] == pytest.approx(500.0) and headline["ipc_gb_s"] == pytest.approx(1000.0)
    failed = gpu_check.headline({"checks": {"a": {"ok": False}}, "large": None})
    assert failed == {"all_ok": False}
