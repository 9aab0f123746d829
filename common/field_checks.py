"""Decoding a message's fields strictly: `from_fields` checks every field of a `common.types` message against its
annotation and bounds (the module docstring there: versions, counts, finite floats, array dtypes and dims, JSON-like
metadata nested at most MAX_JSON_DEPTH) and raises nothing but `ContractError`; `to_fields` is its inverse.

    fields = to_fields(message)                 # plain values and arrays, what `common.wire` packs
    message = from_fields(type(message), fields)   # what `common.wire.decode` does with a received frame

The checkers are built once per field type and cached, so decoding costs one call per field, not per list item.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

import numpy as np

from common.types import MAX_COUNT, ContractError

Checker = typing.Callable[[Any, str], Any]
_CHECKERS: dict[Any, Checker] = {}
_SCALARS = (int, float, str, bool, type(None))


def _checker(annotation: Any, meta: tuple = ()) -> Checker:
    """A function (value, path) -> value that enforces `annotation` strictly (no coercion but int -> float),
    and the bounds of the module docstring: integers within the field's [low, high] (`count`, `version`; else
    +-MAX_COUNT), floats finite.

    Built once per field type and cached: decoding a message costs one call per field, not per list item.
    """
    key = (annotation, meta)
    if key not in _CHECKERS:
        _CHECKERS[key] = _build_checker(annotation, dict(meta))
    return _CHECKERS[key]


def _fail(path: str, expected: str, value: Any) -> typing.NoReturn:
    raise ContractError(f"{path}: expected {expected}, got {type(value).__name__}")


def _out_of_bounds(path: str, low: int, high: int, value: Any, items: bool = False) -> typing.NoReturn:
    """Raise ContractError for a value that is not an int within [low, high]; `items`: the field is a list of
    such ints, and the error names its first bad item (a list where one int belongs is refused as a list)."""
    if items:
        if type(value) is not list:
            _fail(path, "a list of int", value)
        index = next((i for i, v in enumerate(value) if type(v) is not int or not low <= v <= high), None)
        if index is None:  # only reached by a caller that passed a good list: refuse it all the same
            raise ContractError(f"{path}: refused (a list of int within [{low}, {high}])")
        path, value = f"{path}[{index}]", value[index]
    if type(value) is not int:
        _fail(path, "an int", value)
    raise ContractError(f"{path}: {value} is outside [{low}, {high}]")


MAX_JSON_DEPTH = 32  # nesting of a JSON-like value (PromptItem.metadata): deeper is refused, never recursed into


def _check_json(value: Any, path: str) -> Any:
    """A JSON-like value (nil, bool, int within +-MAX_COUNT, finite float, str, list, map with str keys), nested at
    most MAX_JSON_DEPTH deep: checked without recursion, so that no depth raises anything but ContractError."""
    stack = [(value, path, 0)]
    while stack:
        item, where, depth = stack.pop()
        kind = type(item)
        if item is None or kind in (bool, str):
            continue
        if kind is int:
            if not -MAX_COUNT <= item <= MAX_COUNT:
                _out_of_bounds(where, -MAX_COUNT, MAX_COUNT, item)
        elif kind is float:
            if not math.isfinite(item):
                raise ContractError(f"{where}: must be finite (got {item})")
        elif kind in (list, dict):
            if depth >= MAX_JSON_DEPTH:
                raise ContractError(f"{where}: nested deeper than {MAX_JSON_DEPTH}")
            if kind is list:
                stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(item))
            else:
                for k, v in item.items():
                    if type(k) is not str:
                        _fail(f"{where}.<key>", "a str key", k)
                    stack.append((v, f"{where}.{k[:40]}", depth + 1))
        else:
            _fail(where, "a JSON-like value (nil, bool, int, float, str, list, map)", item)
    return value


def _build_checker(annotation: Any, meta: dict) -> Checker:
    if "dtype" in meta:
        dtype, ndim = meta["dtype"], meta["ndim"]

        def check_array(value: Any, path: str) -> Any:
            if not isinstance(value, np.ndarray):
                _fail(path, "an array", value)
            if value.dtype != dtype or value.ndim != ndim:
                raise ContractError(f"{path}: expected {dtype} with {ndim} dims, got {value.dtype} {value.shape}")
            return value

        return check_array
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return _check_json
    if annotation is np.ndarray:
        return lambda value, path: value if isinstance(value, np.ndarray) else _fail(path, "an array", value)
    if annotation is float:

        def check_float(value: Any, path: str) -> float:
            if type(value) not in (int, float):
                _fail(path, "a number", value)
            if not math.isfinite(value):
                raise ContractError(f"{path}: must be finite (got {value})")
            return float(value)

        return check_float
    low, high = meta.get("low", -MAX_COUNT), meta.get("high", MAX_COUNT)
    if annotation is int:
        return lambda value, path: (
            value if type(value) is int and low <= value <= high else _out_of_bounds(path, low, high, value)
        )
    if annotation in (str, bool):
        return lambda value, path: value if type(value) is annotation else _fail(path, annotation.__name__, value)
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if item_type is int:  # fast path: one pass, no call per item
            return lambda value, path: (
                value
                if type(value) is list and all(type(v) is int and low <= v <= high for v in value)
                else _out_of_bounds(path, low, high, value, items=True)
            )
        if item_type in (str, bool):
            return lambda value, path: (
                value
                if type(value) is list and all(type(v) is item_type for v in value)
                else _fail(path, f"a list of {item_type.__name__}", value)
            )
        item = _checker(item_type)
        return lambda value, path: (
            [item(v, f"{path}[{i}]") for i, v in enumerate(value)]
            if type(value) is list
            else _fail(path, "a list", value)
        )
    if origin is dict:
        key_type, value_type = typing.get_args(annotation)
        check_key, check_value = _checker(key_type), _checker(value_type)
        return lambda value, path: (
            {check_key(k, f"{path}.<key>"): check_value(v, f"{path}.{str(k)[:40]}") for k, v in value.items()}
            if type(value) is dict
            else _fail(path, "a map", value)
        )
    if origin in (typing.Union, types.UnionType):
        options = [_checker(option) for option in typing.get_args(annotation) if option is not type(None)]
        nullable = type(None) in typing.get_args(annotation)

        def check_union(value: Any, path: str) -> Any:
            if value is None and nullable:
                return None
            for option in options:
                try:
                    return option(value, path)
                except ContractError:
                    continue
            raise ContractError(f"{path}: {type(value).__name__} is none of {annotation}")

        return check_union
    if dataclasses.is_dataclass(annotation):
        return lambda value, path: from_fields(annotation, value, path)
    raise TypeError(f"unsupported field type {annotation}")


_FIELDS: dict[type, list[tuple[str, bool, Checker]]] = {}


def _field_checkers(cls: type) -> list[tuple[str, bool, Checker]]:
    if cls not in _FIELDS:
        hints = typing.get_type_hints(cls)
        _FIELDS[cls] = [
            (
                f.name,
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
                _checker(hints[f.name], tuple(sorted(f.metadata.items()))),
            )
            for f in dataclasses.fields(cls)
        ]
    return _FIELDS[cls]


def from_fields(cls: type, fields: Any, path: str = "") -> Any:
    """Build a message of type `cls` from a decoded map, checking every field, then `validate()` if defined."""
    path = path or cls.WIRE_NAME
    if type(fields) is not dict:
        _fail(path, "a map of fields", fields)
    checkers = _field_checkers(cls)
    if len(fields) > len(checkers) or not fields.keys() <= {name for name, _, _ in checkers}:
        unknown = set(fields) - {name for name, _, _ in checkers}
        raise ContractError(f"{path}: unknown fields {sorted(str(name)[:40] for name in unknown)[:8]}")
    values = {}
    for name, required, check in checkers:
        if name in fields:
            values[name] = check(fields[name], f"{path}.{name}")
        elif required:
            raise ContractError(f"{path}.{name}: missing")
    obj = cls(**values)
    if hasattr(obj, "validate"):
        obj.validate()
    return obj


def to_fields(obj: Any) -> dict[str, Any]:
    """The fields of a message as a map (nested messages become maps; arrays stay arrays)."""
    return {spec.name: _plain(getattr(obj, spec.name)) for spec in dataclasses.fields(obj)}


def _plain(value: Any) -> Any:
    if isinstance(value, (_SCALARS, np.ndarray)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_fields(value)
    if isinstance(value, list):
        return value if all(isinstance(v, _SCALARS) for v in value) else [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
