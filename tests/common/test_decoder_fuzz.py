"""The decoder fuzzed by its schema (issue 37): whatever a peer sends, `decode` returns a valid message or raises
`WireError`, and `from_fields` raises nothing but `ContractError`. The one exception that escaped (StopIteration from a
list where an integer belongs) killed every service that decodes before it checks a role.

Per registered message type, a base map of fields (each field at a simple valid value, or a real message where one is
at hand) has one field replaced by a value of every msgpack kind: nil, bool, ints at and past every bound, floats
(NaN, inf), str, bin, lists (of ints in range too), maps (str and bin keys), nesting (deeper than anything allows)
and arrays of every wire dtype and shape. Then raw frames: random bytes, valid frames truncated or garbled, wrong
frame counts and headers whose p, t, a are of the wrong kind. Bounded: well under a minute on one core.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.field_checks import from_fields
from common.types import MAX_COUNT, MESSAGE_TYPES, PROTOCOL_VERSION, ContractError, LeaseRequest
from common.wire import ALLOWED_DTYPES, ARRAY_EXT, WireError, decode, encode
from tests.buffers.fakes import make_group

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = sorted(MESSAGE_TYPES)


def header_frames(name: Any, fields: Any, version: Any = PROTOCOL_VERSION, arrays: Any = None) -> list[bytes]:
    """Frames as `common.wire.encode` lays them out, for any field map (arrays become ext descriptors + frames)."""
    frames: list[bytes] = []

    def pack_array(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            frames.append(np.ascontiguousarray(obj).tobytes())
            return msgpack.ExtType(ARRAY_EXT, msgpack.packb([len(frames), obj.dtype.str, list(obj.shape)]))
        raise TypeError(type(obj).__name__)

    packer = msgpack.Packer(default=pack_array, use_bin_type=True)
    packed_fields = packer.pack(fields)
    count = len(frames) if arrays is None else arrays
    head = [packer.pack_map_header(4), packer.pack("p"), packer.pack(version), packer.pack("t"), packer.pack(name)]
    header_with_count = b"".join([*head, packer.pack("f"), packed_fields, packer.pack("a"), packer.pack(count)])
    return [header_with_count, *frames]


def base_value(annotation: Any, meta: Any) -> Any:
    """A simple value that passes the field's own checker (validate() may still refuse the message)."""
    if "dtype" in meta:
        return np.zeros(1, meta["dtype"])
    if annotation is int:
        return max(0, meta.get("low", 0))
    if annotation is float:
        return 0.0
    if annotation is str:
        return "x"
    if annotation is bool:
        return False
    if annotation is np.ndarray:
        return np.zeros(1, np.int32)
    origin = typing.get_origin(annotation)
    if origin is list:
        (item,) = typing.get_args(annotation)
        return [base_value(item, meta)]
    if origin is dict:
        return {"k": base_value(typing.get_args(annotation)[1], {})}
    if dataclasses.is_dataclass(annotation):
        return base_fields(annotation)
    return None  # Any, or an optional


def base_fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: base_value(hints[f.name], f.metadata) for f in dataclasses.fields(cls)}


def encoded_fields_with_arrays(message: Any) -> dict[str, Any]:
    return {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}


BASES: dict[str, list[dict[str, Any]]] = {name: [base_fields(cls)] for name, cls in MESSAGE_TYPES.items()}
BASES["group"].append(encoded_fields_with_arrays(make_group(1, (2, 0))))

ints = st.one_of(
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from([-1, 0, 1, 2**31 - 1, 2**31, MAX_COUNT, MAX_COUNT + 1, -MAX_COUNT - 1, 2**63 - 1, 2**64 - 1]),
)
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.nan, math.inf, -math.inf]))
arrays = st.builds(
    lambda dtype, shape: np.zeros(shape, dtype),
    st.sampled_from(sorted(ALLOWED_DTYPES)),
    st.lists(st.integers(0, 3), max_size=3).map(tuple),
)
scalars = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=8), st.binary(max_size=8), arrays)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(max_size=4), inner, max_size=3),
        st.dictionaries(st.binary(max_size=4), inner, max_size=2),
    ),
    max_leaves=12,
)
nested = st.integers(1, 200).map(lambda depth: _nest(depth))
in_range_lists = st.lists(st.integers(0, 100), max_size=4)  # the first bug: a list where one int belongs
replacements = st.one_of(values, nested, in_range_lists)


def _nest(depth: int) -> Any:
    value: Any = 1
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def decodes_or_refuses(frames: list[bytes], cls: type | None = None) -> None:
    try:
        message, _ = decode(frames)
    except WireError:
        return
    if cls is not None:
        assert type(message) is cls


@pytest.mark.parametrize("name", NAMES)
@FUZZ
@given(data=st.data())
def test_every_field_of_every_message_with_a_value_of_any_kind(name: str, data: st.DataObject) -> None:
    cls = MESSAGE_TYPES[name]
    fields = dict(data.draw(st.sampled_from(BASES[name])))
    for field_name in data.draw(st.lists(st.sampled_from(sorted(fields) or ["extra"]), min_size=1, max_size=2)):
        fields[field_name] = data.draw(replacements)
    if data.draw(st.booleans()):  # a field missing, or one the type does not have
        fields.pop(data.draw(st.sampled_from(sorted(fields) or ["extra"])), None)
    if data.draw(st.integers(0, 9)) == 0:
        fields[data.draw(st.text(max_size=6))] = 1
    try:
        from_fields(cls, _with_arrays_as_received(fields))
    except ContractError:
        pass
    decodes_or_refuses(header_frames(name, fields), cls)


def _with_arrays_as_received(value: Any) -> Any:
    """What the decoder hands `from_fields`: arrays read-only, maps and lists as they are."""
    if isinstance(value, np.ndarray):
        value = value.copy()
        value.flags.writeable = False
    elif isinstance(value, dict):
        value = {k: _with_arrays_as_received(v) for k, v in value.items()}
    elif isinstance(value, list):
        value = [_with_arrays_as_received(v) for v in value]
    return value


@pytest.mark.parametrize("fields", [{"generator_id": []}, {"generator_id": [1, 2]}, {"generator_id": [0]}])
def test_a_list_where_an_integer_belongs_is_a_wire_error(fields: dict[str, Any]) -> None:
    """Issue 37: StopIteration escaped decode() for these, before any role check, in every service."""
    full = {"generator_id": 0, "max_prompts": 1, "policy_version": 0, **fields}
    with pytest.raises(WireError) as refused:
        decode(header_frames("lease_request", full))
    assert refused.value.kind == "invalid_fields" and "generator_id" in refused.value.reason


def test_metadata_holds_json_like_values_only() -> None:
    good = {"prompt_id": 0, "epoch": 0, "messages": [], "metadata": {"answer": "4", "n": [1, 2.5, None, {"a": True}]}}
    assert decode(header_frames("prompt", good))[0].metadata == good["metadata"]
    for bad in (np.zeros(2, np.int32), b"bytes", math.nan, _nest(200), {"k": 2**63}):
        with pytest.raises(WireError):
            decode(header_frames("prompt", {**good, "metadata": {"x": bad}}))


header_values = st.one_of(values, st.sampled_from(NAMES), st.just(PROTOCOL_VERSION))


@FUZZ
@given(version=header_values, name=header_values, count=st.one_of(ints, values), extra=st.integers(0, 3))
def test_headers_of_the_wrong_kind_are_refused(version: Any, name: Any, count: Any, extra: int) -> None:
    """p, t, a of any kind (an array for p once raised 'truth value of an array is ambiguous')."""
    frames = header_frames(name, {}, version=version, arrays=count)
    decodes_or_refuses(frames + [b"\0" * 8] * extra)


@FUZZ
@given(frames=st.lists(st.binary(max_size=64), max_size=4))
def test_random_frames_are_refused(frames: list[bytes]) -> None:
    decodes_or_refuses(frames)


@FUZZ
@given(data=st.data())
def test_valid_frames_truncated_garbled_or_miscounted_are_refused_or_valid(data: st.DataObject) -> None:
    frames = [bytes(f) for f in encode(make_group(1, (2, 0), tokens=data.draw(st.integers(1, 4))))]
    index = data.draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[index])
    action = data.draw(st.sampled_from(["truncate", "flip", "drop", "duplicate", "append"]))
    if action == "truncate":
        frames[index] = bytes(frame[: data.draw(st.integers(0, max(0, len(frame) - 1)))])
    elif action == "flip" and frame:
        position = data.draw(st.integers(0, len(frame) - 1))
        frame[position] ^= data.draw(st.integers(1, 255))
        frames[index] = bytes(frame)
    elif action == "drop":
        del frames[index]
    elif action == "duplicate":
        frames.insert(index, frames[index])
    else:
        frames.append(data.draw(st.binary(max_size=16)))
    decodes_or_refuses(frames)


def test_a_valid_message_still_decodes() -> None:
    message = LeaseRequest(generator_id=3, max_prompts=2, policy_version=1)
    assert decode(encode(message))[0] == message
    group = make_group(1, (2, 0))
    assert decode(header_frames("group", encoded_fields_with_arrays(group)))[0].group_id == group.group_id
