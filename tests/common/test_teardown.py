"""common.teardown.skip_exit_gc and the vLLM plugin that applies it in the processes vLLM starts."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration  # starts a Python process
def test_the_collector_is_off_from_the_exit_handlers_on_and_only_then() -> None:
    """A handler registered before skip_exit_gc runs after its handler (atexit is last in, first out) and sees the
    collector off; while the program runs, it is on. Two calls register one handler."""
    program = (
        "import atexit, gc\n"
        "atexit.register(lambda: print('at exit', gc.isenabled()))\n"
        "from common.teardown import skip_exit_gc\n"
        "skip_exit_gc(); skip_exit_gc()\n"
        "print('running', gc.isenabled())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], check=False, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n") == ["running True", "at exit False", ""]


def test_vllm_loads_the_plugin_in_its_processes() -> None:
    """The entry point vLLM's load_general_plugins reads names actors.engine.vllm_plugin.register (installed with the
    package: pyproject.toml)."""
    from actors.engine.vllm_plugin import register

    [plugin] = [e for e in entry_points(group="vllm.general_plugins") if e.name == "tandem"]
    assert plugin.load() is register
