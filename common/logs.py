"""One logger per process that stamps every line with the role and index: `generator-0`, `buffer-0`, `learner-1`.

    log = setup_logging("generator", 0, run_dir)   # once, at the start of a role's run()
    log.info("loaded weights v%d in %.2fs", version, seconds)

Lines go to stderr and to `<run_dir>/logs/<role>-<index>.log`. In a SIMULATION run (`run.simulate = true`: pass
`simulation=True`, as every role and launcher does), every line of the process says so in its stamp:
`12:00:00 I [learner-0 SIMULATION] tandem: step 3/10 ...`, lines of other libraries' loggers included.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname).1s [{stamp}] %(name)s: %(message)s"


def stamp(role: str, index: int, simulation: bool = False) -> str:
    """What every line of the process is stamped with: 'learner-0', or 'learner-0 SIMULATION'."""
    return f"{role}-{index} SIMULATION" if simulation else f"{role}-{index}"


def setup_logging(
    role: str, index: int, run_dir: Path | None = None, level: int = logging.INFO, simulation: bool = False
) -> logging.Logger:
    """Configure the root logger for this process (idempotent) and return the `tandem` logger. `simulation`
    (the run's `run.simulate`) adds SIMULATION to the stamp of every line."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_tandem", False):
            root.removeHandler(handler)
            handler.close()
    formatter = logging.Formatter(FORMAT.format(stamp=stamp(role, index, simulation)), datefmt="%H:%M:%S")
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
