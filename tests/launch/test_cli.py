"""The `tandem` command answers --help at once and reports config errors in one line per problem."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

TANDEM = [sys.executable, "-m", "launch.cli"]
ENGINES = ("torch", "vllm", "deepspeed", "ray", "transformers")
# `tandem ARGS` as `python -m launch.cli` runs it, then the engines it imported, on stderr's last line
HELP_PROBE = f"""
import runpy, sys
sys.argv = ["tandem", *sys.argv[1:]]
try:
    runpy.run_module("launch.cli", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    assert exit.code in (0, None), exit.code
print(sorted({{name.split(".")[0] for name in sys.modules}} & set({ENGINES!r})), file=sys.stderr)
"""


def run_help(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """(`tandem *args` run through HELP_PROBE, seconds it took); the engines it imported are checked to be none."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", HELP_PROBE, *args], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "[]", result.stderr  # no engine imported for --help
    return result, seconds


@pytest.mark.integration
def test_help_is_fast_and_imports_no_engine() -> None:
    # "fast" is what importing no engine buys (checked by run_help, on any machine); the wall-clock bound is only
    # a backstop, loose enough for a loaded 2-core machine (it answers in ~0.3 s; an engine import takes seconds)
    result, seconds = run_help("--help")
    assert seconds < 10.0
    for command in ("demo", "run", "buffer", "generator", "learner", "ray"):
        assert command in result.stdout


@pytest.mark.integration
def test_config_error_exits_2_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[learner]\nlr = -1\n")
    result = subprocess.run([*TANDEM, "config", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert "learner.lr: Input should be greater than 0 (got -1)" in result.stderr


@pytest.mark.integration
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
