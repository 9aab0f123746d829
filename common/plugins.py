"""Resolve a user's plug-in named as `"package.module:attribute"` (reward functions, environments).

One place for the parsing, the import and the error messages, so that every plug-in fails the same way: a message
that names the config key, the spec and what to change.

Where a plug-in imports from is one rule for every launcher: the folders of `env.plugin_paths` as `load_config`
resolves them (the config file's folder, the folders written there, the current directory), searched first, then
PYTHONPATH and the installed packages. `tandem run` and `tandem ray` write the resolved list into
`<run_dir>/config.json`, so a role started there, by hand or on a Ray node finds the same module whatever its
working directory:

    resolve_callable("my_rewards:exact_match", "reward function", "module.path:function", "a callable",
                     search_path=config.env.plugin_paths)
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any


def search_first(folders: Sequence[str]) -> None:
    """Put `folders` at the front of `sys.path`, in this order (an entry already elsewhere moves), as Python puts a
    script's own folder first. Idempotent; the import system's caches are refreshed when the path changes."""
    if sys.path[: len(folders)] == list(folders):
        return
    for folder in reversed(folders):
        while folder in sys.path:
            sys.path.remove(folder)
        sys.path.insert(0, folder)
    importlib.invalidate_caches()


def _searched(search_path: Sequence[str]) -> str:
    folders = f"env.plugin_paths {list(search_path)}, then " if search_path else ""
    return (
        f"searched {folders}PYTHONPATH and the installed packages: put it beside the config file, name its folder "
        "in env.plugin_paths, or install it"
    )


# Modules a config may name that moved into sub-packages (December 2026): an old spec is refused with the new one.
MOVED = {
    "actors.openai_server": "actors.environments.openai_server",
    "actors.verifiers_env": "actors.environments.verifiers_env",
    "actors.sandbox": "actors.environments.sandbox",
    "actors.rewards": "actors.rewards.functions",
}


def resolve_callable(spec: str, what: str, shape: str, kind: str, search_path: Sequence[str] = ()) -> Any:
    """The callable named by `spec` (`"package.module:name"`; a dotted attribute path after the colon also works).

    `what` names the setting in messages ("reward function", "env.environment"), `shape` is the expected form
    ("module.path:function") and `kind` what the target must be ("a callable"). `search_path` (the resolved
    `env.plugin_paths`: absolute folders) is searched first (`search_first`), so the module and the modules it
    imports beside it are found there. Raises ValueError for a malformed spec, ImportError when the module cannot
    be imported (the message says where it was searched), AttributeError when it has no such attribute, TypeError
    when the attribute is not callable.
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"{what} {spec!r}: expected '{shape}'")
    if module_name in MOVED:
        raise ImportError(f"{what} {spec!r}: {module_name} moved: write '{MOVED[module_name]}:{attr_path}'")
    search_first(search_path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and module_name.startswith(error.name):
            raise ImportError(
                f"{what} {spec!r}: cannot import {module_name!r}: no module named {error.name!r} "
                f"({_searched(search_path)})"
            ) from error
        raise ImportError(f"{what} {spec!r}: importing {module_name!r} failed: {error}") from error
    target: Any = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise AttributeError(f"{what} {spec!r}: {module_name!r} has no attribute {attr_path!r}")
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{what} {spec!r}: {attr_path!r} is a {type(target).__name__}, not {kind}")
    return target
