"""Resolve a user's plug-in named as `"package.module:attribute"` (reward functions, environments).

One place for the parsing, the import and the error messages, so that every plug-in fails the same way: a message
that names the config key, the spec and what to change.
"""

from __future__ import annotations

import importlib
from typing import Any


def resolve_callable(spec: str, what: str, shape: str, kind: str) -> Any:
    """The callable named by `spec` (`"package.module:name"`; a dotted attribute path after the colon also works).

    `what` names the setting in messages ("reward function", "env.environment"), `shape` is the expected form
    ("module.path:function") and `kind` what the target must be ("a callable"). Raises ValueError for a malformed
    spec, ImportError when the module cannot be imported (it must be on PYTHONPATH or installed), AttributeError
    when it has no such attribute, TypeError when the attribute is not callable.
    """
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"{what} {spec!r}: expected '{shape}'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and module_name.startswith(error.name):
            raise ImportError(
                f"{what} {spec!r}: cannot import {module_name!r}: no module named {error.name!r} "
                "(put it on PYTHONPATH or install it)"
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
