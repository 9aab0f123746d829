"""One logger per process (common/logs.py): every line stamped with role and index, and SIMULATION in a simulated
run, lines of other libraries' loggers included."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.logs import setup_logging


@pytest.fixture(autouse=True)
def _restore_root_logger() -> Iterator[None]:
    """setup_logging configures the process's root logger: undo it after each test."""
    level = logging.getLogger().level
    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_tandem", False)]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(level)


def _lines(run_dir: Path, name: str) -> list[str]:
    for handler in logging.getLogger().handlers:
        handler.flush()
    return (run_dir / "logs" / name).read_text().splitlines()


def test_every_line_of_a_simulated_role_says_simulation(tmp_path: Path) -> None:
    log = setup_logging("buffer", 0, tmp_path, simulation=True)
    log.info("buffer on 127.0.0.1:5555")
    logging.getLogger("zmq.somewhere").warning("a library's line")
    lines = _lines(tmp_path, "buffer-0.log")
    assert len(lines) == 2 and all("[buffer-0 SIMULATION]" in line for line in lines)


def test_a_real_run_is_not_stamped_simulation(tmp_path: Path) -> None:
    setup_logging("learner", 1, tmp_path).info("step 1/3")
    assert [" [learner-1] " in line and "SIMULATION" not in line for line in _lines(tmp_path, "learner-1.log")] == [
        True
    ]
