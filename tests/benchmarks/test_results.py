"""The saved benchmark results: every one has the `headline` object that issues read their figures from, and a
benchmark's headline is what its own `headline()` makes of the rest of its saved result."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_every_saved_result_has_a_headline(path: Path) -> None:
    result = json.loads(path.read_text())
    if path.stem == "summary":  # benchmarks.run_all: one headline per benchmark it ran
        headlines = [row["headline"] for row in result["benchmarks"]]
    else:
        headlines = [result.get("headline")]
    assert all(isinstance(h, dict) and h for h in headlines), f"{path.name}: a missing or empty headline object"


@pytest.mark.parametrize(
    "name",
    [
        "architectures",
        "broadcast_rounds",
        "buffer_flood",
        "buffer_throughput",
        "curriculum_effect",
        "demo_wall",
        "distillation",
        "env_latency",
        "generator_throughput",
        "house_counts",
        "learner_lora",
        "learner_throughput",
        "ray_overhead",
        "slow_generators",
        "slurm_run",
        "weight_fanout",
        "weight_sync",
        "weights_slow_reader",
        "wire_codec",
        "word_problems_headroom",
    ],
)
def test_the_headline_is_made_from_the_saved_figures(name: str) -> None:
    result = json.loads((RESULTS / f"{name}.json").read_text())
    assert importlib.import_module(f"benchmarks.{name}").headline(result) == result["headline"]
