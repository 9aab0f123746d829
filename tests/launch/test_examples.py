"""Every example config validates, the demo is the documented default (async GRPO, η = 2, SmolLM2), and the configs
the package ships are the ones examples/ shows (one file each: examples/ holds links)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import load_config
from launch.cli import DEMO_CONFIG, PACKAGED_CONFIGS, packaged_configs, resolve_config_path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").rglob("*.toml"))  # examples/rlhf and examples/distill too


@pytest.mark.parametrize("path", EXAMPLES, ids=[str(p.relative_to(REPO / "examples")) for p in EXAMPLES])
def test_example_validates(path: Path) -> None:
    load_config(path)


def test_demo_is_async_grpo_on_the_embedded_model() -> None:
    config = load_config(DEMO_CONFIG)
    assert config.model.path == "smollm2" and config.env.kind == "arithmetic"
    assert config.algo.estimator == "grpo" and config.algo.max_staleness == 2
    assert config.generator.count == 1 and config.learner.world_size == 1
    # η = 0 through the same file is the synchronous baseline
    assert load_config(DEMO_CONFIG, ["--algo.max_staleness", "0"]).algo.max_staleness == 0


def test_the_packaged_configs_are_what_examples_links_to() -> None:
    assert set(packaged_configs()) == {"demo", "gpu_cluster"} and DEMO_CONFIG.parent == PACKAGED_CONFIGS
    for path in packaged_configs().values():
        load_config(path)
        link = REPO / "examples" / path.name
        assert link.is_symlink() and link.resolve() == path.resolve(), f"examples/{path.name} must link to {path}"


def test_config_arguments_name_a_file_or_a_packaged_config(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_config_path("demo") == resolve_config_path("demo.toml") == DEMO_CONFIG
    (tmp_path / "demo.toml").write_text("")
    assert resolve_config_path("demo.toml") == Path("demo.toml")  # a file in the working directory wins
    assert resolve_config_path("nothing.toml") == Path("nothing.toml")  # loading it says "no such config file"
