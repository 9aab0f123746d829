"""The paths a role needs on the machine it runs on, checked by `tandem ROLE` before the role starts.

    problems = missing_paths(config, "buffer")   # [] or ["env.source: '/data/p.jsonl' does not exist on this machine"]

Loading a config checks no path: `tandem config` and `tandem ray` may run where the data, the model and the keys
are not (a laptop submitting to a cluster; `tandem ray` checks nothing a node holds). Each role is started as
`python -m launch.cli ROLE <run_dir>/config.json` on its own machine, locally or by Ray, and checks there, so a
missing path is one line naming the key at start rather than a traceback from deep inside the role.
"""

from __future__ import annotations

from pathlib import Path

from common.config import BUILT_IN_MODELS, TandemConfig
from common.keys import SecurityError, check_keys

# role -> the checks it needs; `run` starts every role on this machine
NEEDS = {
    "run": ("prompts", "model", "keys"),
    "buffer": ("prompts", "keys"),
    "generator": ("model", "keys"),
    "learner": ("model", "keys"),
}
# role -> (the client roles it connects as, whether it serves): which key files it loads (common.keys.check_keys).
# A learner serves the weights on rank 0 only, so its server key is checked when that socket opens.
KEY_USERS = {
    "run": (("generator", "learner"), True),
    "buffer": ((), True),
    "generator": (("generator",), False),
    "learner": (("learner",), False),
}


def _prompts_problem(config: TandemConfig, role: str) -> str | None:
    if config.env.kind != "file":
        return None
    source = Path(config.env.source).expanduser()
    if not source.exists():
        return (
            f"env.source: '{config.env.source}' does not exist on this machine (a .jsonl or .parquet file, or a "
            f"`datasets` folder; a relative path starts at {Path.cwd()})"
        )
    if source.is_file() and source.suffix not in (".jsonl", ".parquet"):
        return f"env.source: '{config.env.source}' must be a .jsonl or .parquet file, or a `datasets` folder"
    return None


def _model_problem(config: TandemConfig, role: str) -> str | None:
    if config.run.simulate or config.model.path in BUILT_IN_MODELS:  # SIMULATION loads no model
        return None
    if not (Path(config.model.path).expanduser() / "config.json").is_file():
        return (
            f"model.path: '{config.model.path}' is not a Hugging Face model directory on this machine (no "
            f"config.json): use {' or '.join(repr(name) for name in BUILT_IN_MODELS)} or a local model directory"
        )
    return None


def _keys_problem(config: TandemConfig, role: str) -> str | None:
    folder = config.run.curve_keys_dir
    if folder is None:
        return None
    if not folder.expanduser().is_dir():
        return (
            f"run.curve_keys_dir: '{folder}' is not a folder on this machine: make the keys with "
            f"`tandem keys {folder}` and give each machine the files its roles need (docs/security.md)"
        )
    clients, serves = KEY_USERS[role]
    try:
        check_keys(folder.expanduser(), clients, serves)
    except SecurityError as error:
        return f"run.curve_keys_dir: {error}"
    return None


CHECKS = {"prompts": _prompts_problem, "model": _model_problem, "keys": _keys_problem}


def missing_paths(config: TandemConfig, role: str) -> list[str]:
    """One line per path that `role` needs and this machine lacks, each naming its key; [] for a role that needs
    none here (`config`, `ray`)."""
    return [problem for need in NEEDS.get(role, ()) if (problem := CHECKS[need](config, role)) is not None]
