"""benchmarks/learner_lora runs end to end on the tiny model and saves the documented figures (no timing checked:
only what holds on any machine, the adapter's share of the bytes and of the optimizer state). float32: on a CPU
without native bf16 (an AMD EPYC here) the bf16 run took 210 s, float32 32 s; the shares are the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.common
from benchmarks import learner_lora


@pytest.mark.deepspeed
def test_learner_lora_writes_its_headline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path / "results")
    assert learner_lora.main(["--model", "tiny", "--steps", "1", "--rank", "4", "--dtype", "float32"]) == 0
    result = json.loads((tmp_path / "results" / "learner_lora.json").read_text())
    assert result["headline"] == learner_lora.headline(result)
    lora, full = result["lora"], result["full"]
    assert lora["sync_mb"] == full["sync_mb"]  # merged: the full layout
    assert 0 < lora["adapter_sync_mb"] < full["sync_mb"] / 20
    assert 0 < lora["optimizer_mb"] < full["optimizer_mb"] / 20
    assert lora["trainable_params"] < full["trainable_params"] == full["total_params"]
    assert result["adapter_sync_mb_by_rank"]["16"] == pytest.approx(2 * result["adapter_sync_mb_by_rank"]["8"])
