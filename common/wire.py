"""Wire protocol: msgpack headers, numpy arrays as raw zero-copy frames, strict validation on decode.

A message is a list of frames:
    frame 0       msgpack map {"p": PROTOCOL_VERSION, "t": wire name, "a": number of array frames, "f": fields}
                  where each numpy array in the fields is an ExtType(ARRAY_EXT, msgpack [frame index, dtype, shape])
    frames 1..a   the arrays' raw bytes (C order), sent without copying
    frames a+1..  optional raw payload (weights buckets), returned to the caller as memoryviews

Nothing received is ever unpickled. `decode` either returns a fully validated message or raises `WireError`
with the reason (garbage, truncated, oversized, wrong type, wrong version); it never returns a half-valid object.
Decoded arrays are read-only views of the received frames: copy before writing to them.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from common import eval_messages, weight_messages  # noqa: F401 (imported, they register their messages)
from common.field_checks import from_fields, to_fields
from common.types import MESSAGE_TYPES, PROTOCOL_VERSION, ContractError

ARRAY_EXT = 1
DEFAULT_MAX_BYTES = 1 << 30
MAX_REASON_CHARS = 500  # a rejection's reason, as logged and sent back (a field's path may hold a peer's key)
# Little-endian (or byte-order-free) numeric dtypes only: no object arrays, no structured dtypes.
ALLOWED_DTYPES = {
    np.dtype(name).str: np.dtype(name)
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
}


class WireError(ValueError):
    """A received message was rejected; `reason` says why (logged), `kind` is a short key (counted):
    garbage, oversized, wrong_version, unknown_type, bad_frames, invalid_fields."""

    def __init__(self, reason: str, kind: str = "invalid_fields") -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


def encode(message: Any, payload: Sequence[memoryview | bytes] = ()) -> list[memoryview | bytes]:
    """Frames for a registered message (see `common.types.message`), plus optional raw payload frames.

    Arrays are not copied when they are already C-contiguous; the caller must not mutate them until sent.
    """
    name = getattr(type(message), "WIRE_NAME", None)
    if name is None:
        raise TypeError(f"{type(message).__name__} is not a registered wire message")
    arrays: list[memoryview] = []

    def pack_array(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.dtype.str not in ALLOWED_DTYPES:
                raise TypeError(f"dtype {obj.dtype} cannot travel on the wire")
            arrays.append(memoryview(np.ascontiguousarray(obj)).cast("B"))
            return msgpack.ExtType(ARRAY_EXT, msgpack.packb([len(arrays), obj.dtype.str, list(obj.shape)]))
        raise TypeError(f"cannot encode {type(obj).__name__}")

    # One pass: the map's entries are packed in order, so "a" (the array count) can follow "f".
    packer = msgpack.Packer(default=pack_array, use_bin_type=True)
    header = b"".join(
        [
            packer.pack_map_header(4),
            packer.pack("p"),
            packer.pack(PROTOCOL_VERSION),
            packer.pack("t"),
            packer.pack(name),
            packer.pack("f"),
            packer.pack(to_fields(message)),
            packer.pack("a"),
            packer.pack(len(arrays)),
        ]
    )
    return [header, *arrays, *payload]


def _frame_bytes(frame: Any) -> memoryview:
    if hasattr(frame, "buffer"):  # zmq.Frame received with copy=False
        return frame.buffer
    return memoryview(frame)


def decode(frames: Sequence[Any], max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[Any, list[memoryview]]:
    """(message, payload frames) from received frames, or raise `WireError` with the reason."""
    views = [_frame_bytes(f) for f in frames]
    if not views:
        raise WireError("empty message", "bad_frames")
    total = sum(v.nbytes for v in views)
    if total > max_bytes:
        raise WireError(f"message of {total} bytes exceeds the limit of {max_bytes}", "oversized")
    head = views[0]
    limit = min(head.nbytes, 1 << 24)
    highest_frame = [0]  # the highest frame index an array descriptor referred to
    try:
        header = msgpack.unpackb(
            head,
            raw=False,
            strict_map_key=True,
            ext_hook=lambda code, data: _array_from_frame(code, data, views, highest_frame),
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=limit,
        )
    except WireError:
        raise
    except Exception as error:  # noqa: BLE001 - msgpack raises many types for garbage; all mean the same here
        raise WireError(f"header is not valid msgpack: {type(error).__name__}: {error}", "garbage") from None
    if type(header) is not dict or header.keys() != {"p", "t", "a", "f"}:
        raise WireError("header must be a map with exactly the keys p, t, a, f", "garbage")
    if type(header["p"]) is not int or header["p"] != PROTOCOL_VERSION:  # an array's == is no bool: type first
        raise WireError(
            f"protocol version {_short(header['p'])} != {PROTOCOL_VERSION} (upgrade the older peer)", "wrong_version"
        )
    cls = MESSAGE_TYPES.get(header["t"]) if isinstance(header["t"], str) else None
    if cls is None:
        raise WireError(f"unknown message type {_short(header['t'])}", "unknown_type")
    num_arrays = header["a"]
    if type(num_arrays) is not int or not 0 <= num_arrays <= len(views) - 1:
        raise WireError(f"array frame count {_short(num_arrays)} does not fit {len(views) - 1} frames", "bad_frames")
    if highest_frame[0] > num_arrays:
        raise WireError(f"an array refers to a frame beyond the {num_arrays} array frames", "bad_frames")
    try:
        message = from_fields(cls, header["f"])
    except ContractError as error:
        raise WireError(str(error)[:MAX_REASON_CHARS], "invalid_fields") from None
    return message, views[1 + num_arrays :]


def _short(value: Any) -> str:
    """A received value for a reason: its repr cut to 80 characters, or its type where repr fails (a list nested
    a thousand deep exceeds the recursion limit)."""
    try:
        return reprlib.repr(value)[:80]
    except Exception:  # noqa: BLE001 - any value a peer sent; its type is enough to say what was wrong
        return f"<{type(value).__name__}>"


def _array_from_frame(code: int, data: bytes, views: list[memoryview], highest_frame: list[int]) -> np.ndarray:
    """Msgpack ext hook: an array descriptor [frame index, dtype, shape] -> a read-only view of that frame."""
    if code != ARRAY_EXT:
        raise WireError(f"unknown msgpack extension type {code}", "garbage")
    try:
        index, dtype, shape = msgpack.unpackb(data, raw=False, max_array_len=64)
    except Exception:  # noqa: BLE001 - msgpack raises many types for garbage; all mean the same here
        raise WireError("malformed array descriptor", "garbage") from None
    if type(index) is not int or not 1 <= index < len(views):
        raise WireError(f"array descriptor refers to frame {_short(index)} of {len(views)}", "bad_frames")
    if type(dtype) is not str or dtype not in ALLOWED_DTYPES:
        raise WireError(f"array descriptor with bad dtype {_short(dtype)}", "garbage")
    if type(shape) is not list or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
        raise WireError(f"array descriptor with bad shape {_short(shape)}", "garbage")
    dtype = ALLOWED_DTYPES[dtype]
    frame = views[index]
    expected = math.prod(shape) * dtype.itemsize
    if frame.nbytes != expected:
        raise WireError(f"array frame {index} holds {frame.nbytes} bytes, shape needs {expected}", "bad_frames")
    array = np.frombuffer(frame, dtype=dtype).reshape(shape)
    array.flags.writeable = False
    highest_frame[0] = max(highest_frame[0], index)
    return array
