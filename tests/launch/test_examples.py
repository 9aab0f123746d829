"""Every example config validates, and the demo is the documented default (async GRPO, η = 2, SmolLM2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import load_config
from launch.cli import DEMO_CONFIG

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_validates(path: Path) -> None:
    load_config(path)


def test_demo_is_async_grpo_on_the_embedded_model() -> None:
    config = load_config(DEMO_CONFIG)
    assert config.model.path == "smollm2" and config.env.kind == "arithmetic"
    assert config.algo.estimator == "grpo" and config.algo.max_staleness == 2
    assert config.generator.count == 1 and config.learner.world_size == 1
    # η = 0 through the same file is the synchronous baseline
    assert load_config(DEMO_CONFIG, ["--algo.max_staleness", "0"]).algo.max_staleness == 0
