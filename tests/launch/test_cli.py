"""The `tandem` command answers --help at once and reports config errors in one line per problem."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

TANDEM = [sys.executable, "-m", "launch.cli"]


def test_help_is_fast_and_imports_no_engine() -> None:
    start = time.perf_counter()
    result = subprocess.run([*TANDEM, "--help"], capture_output=True, text=True, check=True)
    assert time.perf_counter() - start < 2.0
    for command in ("demo", "run", "buffer", "generator", "learner", "ray"):
        assert command in result.stdout


def test_config_error_exits_2_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[learner]\nlr = -1\n")
    result = subprocess.run([*TANDEM, "config", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert "learner.lr: Input should be greater than 0 (got -1)" in result.stderr


def test_config_prints_resolved_values(tmp_path: Path) -> None:
    path = tmp_path / "ok.toml"
    path.write_text("[algo]\nmax_staleness = 3\n")
    result = subprocess.run(
        [*TANDEM, "config", str(path), "--learner.lr", "5e-7"], capture_output=True, text=True, check=True
    )
    assert '"max_staleness": 3' in result.stdout and '"lr": 5e-7' in result.stdout


def test_config_reference_is_up_to_date() -> None:
    from launch.config_docs import render

    committed = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert committed.read_text() == render(), "regenerate: python -m launch.config_docs > docs/config.md"
