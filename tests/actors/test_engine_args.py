"""actors/engine/vllm.py: what VllmEngine asks vLLM for (no engine is started: LLMEngine.from_engine_args is stopped)."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.engine.api import SamplingSettings
from common.config import ModelConfig


class _Stopped(Exception):
    pass


@pytest.mark.parametrize(("cuda", "eager"), [(False, True), (True, False)])
def test_the_memory_fraction_and_the_platform_s_eager_mode_reach_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: bool, eager: bool
) -> None:
    import vllm
    from vllm.platforms import current_platform

    from actors.engine.vllm import VllmEngine

    asked = {}

    def capture(args):  # stands in for LLMEngine.from_engine_args
        asked.update(eager=args.enforce_eager, memory=args.gpu_memory_utilization)
        raise _Stopped

    monkeypatch.setattr(vllm.LLMEngine, "from_engine_args", staticmethod(capture))
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: cuda)
    settings = SamplingSettings(temperature=1.0, top_p=1.0, max_tokens=8, seed=0)
    with pytest.raises(_Stopped):
        VllmEngine(tmp_path, ModelConfig(dtype="float32"), settings, 8, "auto", gpu_memory_utilization=0.5)
    assert asked == {"eager": eager, "memory": 0.5}
