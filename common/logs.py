"""One logger per process that stamps every line with the role and index: `generator-0`, `buffer-0`, `learner-1`.

    log = setup_logging("generator", 0, run_dir)   # once, at the start of a role's run()
    log.info("loaded weights v%d in %.2fs", version, seconds)

Lines go to stderr and to `<run_dir>/logs/<role>-<index>.log`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname).1s [{role}-{index}] %(name)s: %(message)s"


def setup_logging(role: str, index: int, run_dir: Path | None = None, level: int = logging.INFO) -> logging.Logger:
    """Configure the root logger for this process (idempotent) and return the `tandem` logger."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_tandem", False):
            root.removeHandler(handler)
            handler.close()
    formatter = logging.Formatter(FORMAT.format(role=role, index=index), datefmt="%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if run_dir is not None:
        log_dir = Path(run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_dir / f"{role}-{index}.log"))
    for handler in handlers:
        handler._tandem = True  # type: ignore[attr-defined]
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("urllib3", "filelock", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger("tandem")
