"""common/devices.py: the device rules the roles apply before starting an engine."""

from __future__ import annotations

import pytest

from common.config import ConfigError, load_config
from common.devices import vllm_eager


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
