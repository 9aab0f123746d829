"""Wire protocol: every message type round-trips; garbage, truncation, mutation, oversize and wrong versions
raise only `WireError`; nothing decoded is half-valid."""

from __future__ import annotations

import dataclasses
import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import types as t
from common import weight_messages as wm
from common.field_checks import from_fields, to_fields
from common.wire import WireError, decode, encode

small_int = st.integers(min_value=-(2**31), max_value=2**31 - 1)
version = st.integers(0, t.MAX_VERSION)  # versions and steps decode only within [0, MAX_VERSION]
text = st.text(max_size=20)
# finite floats only: the wire refuses inf and nan in metadata (tests/common/test_decoder_fuzz.py sends them)
metadata = st.dictionaries(
    text, st.one_of(small_int, text, st.booleans(), st.floats(allow_nan=False, allow_infinity=False)), max_size=4
)


@st.composite
def groups(draw: st.DrawFn) -> t.RolloutGroup:
    n = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    names = draw(st.lists(st.sampled_from(["correct", "format", "kl"]), unique=True, max_size=3))
    return t.RolloutGroup(
        lease_id=draw(st.integers(0, 2**40)),
        prompt_id=draw(st.integers(0, 2**31)),
        epoch=draw(st.integers(0, 100)),
        generator_id=draw(st.integers(0, 64)),
        prompt_tokens=rng.integers(0, 49152, draw(st.integers(0, 30))).astype(np.int32),
        offsets=offsets,
        completion_tokens=rng.integers(0, 49152, total).astype(np.int32),
        behaviour_logprobs=-rng.random(total).astype(np.float32),
        loss_mask=rng.integers(0, 2, total).astype(np.uint8),
        token_versions=rng.integers(0, 10, total).astype(np.int32),
        versions=rng.integers(0, 10, n).astype(np.int32),
        rewards=rng.random(n).astype(np.float32),
        reward_components={k: rng.random(n).astype(np.float32) for k in names},
        finish_reasons=draw(st.lists(st.sampled_from(["stop", "length", "error: boom"]), min_size=n, max_size=n)),
        started_at=draw(st.floats(0, 2e9)),
        finished_at=draw(st.floats(0, 2e9)),
    )


prompt_items = st.builds(
    t.PromptItem,
    prompt_id=st.integers(0, 2**31),
    epoch=st.integers(0, 99),
    messages=st.lists(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": text}), max_size=3
    ),
    metadata=metadata,
)
tensor_specs = st.builds(
    wm.TensorSpec,
    name=text,
    dtype=st.sampled_from(["bfloat16", "float32"]),
    shape=st.lists(st.integers(0, 9), max_size=3),
    bucket=st.just(0),
    offset=st.just(0),
    nbytes=st.integers(0, 16),
)
MESSAGES = st.one_of(
    prompt_items,
    st.builds(t.LeaseRequest, generator_id=st.integers(0, 99), max_prompts=st.integers(0, 99), policy_version=version),
    st.builds(
        t.LeaseGrant,
        lease_id=st.integers(0, 2**40),
        deadline=st.floats(0, 2e9),
        prompts=st.lists(prompt_items, max_size=3),
    ),
    st.builds(t.LeaseRefused, reason=text, min_version=version, retry_after_s=st.floats(0, 60)),
    st.builds(
        t.Heartbeat,
        generator_id=st.integers(0, 99),
        policy_version=version,
        lease_ids=st.lists(st.integers(0, 2**40)),
    ),
    st.builds(
        t.LeaseReturn,
        generator_id=st.integers(0, 99),
        lease_id=st.integers(0, 2**40),
        prompt_ids=st.lists(st.integers(0, 2**31)),
    ),
    groups(),
    st.builds(t.GroupAck, lease_id=st.integers(0, 99), prompt_id=st.integers(0, 99), status=text, reason=text),
    st.builds(
        t.BatchRequest,
        step=st.integers(0, 10**6),
        rank=st.integers(0, 7),
        world_size=st.integers(1, 8),
        num_groups=st.integers(1, 64),
        timeout_s=st.floats(0, 60),
    ),
    st.builds(t.BatchNotReady, step=st.integers(0, 99), buffered=st.integers(0, 99)),
    st.builds(t.VersionReport, policy_version=version, step=version, resync=st.booleans(), final=st.booleans()),
    st.builds(t.RunOver, step=version),
    st.builds(t.Ok, learner_version=version),
    st.builds(t.ErrorReply, reason=text),
    st.builds(t.StatsRequest),
    st.builds(t.BufferStats, counters=st.dictionaries(text, st.integers(0, 2**40)), learner_version=version),
    st.builds(wm.WeightsRequest, generator_id=st.integers(0, 99), have_version=st.integers(-1, t.MAX_VERSION)),
    st.builds(
        wm.WeightsHeader,
        policy_version=version,
        tensors=st.lists(tensor_specs, max_size=3),
        bucket_sizes=st.just([16]),
        transport=st.sampled_from(["zmq", "nccl"]),
    ),
    st.builds(wm.WeightsNotNewer, latest_version=st.integers(-1, t.MAX_VERSION)),
)


def assert_equal(a: object, b: object) -> None:
    assert type(a) is type(b)
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_equal(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_equal(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_equal(a[k], b[k])
    else:
        assert a == b


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(MESSAGES)
def test_every_message_round_trips(message: object) -> None:
    frames = [bytes(f) for f in encode(message)]
    decoded, payload = decode(frames)
    assert_equal(decoded, message)
    assert payload == []


@settings(max_examples=50)
@given(st.lists(groups(), min_size=1, max_size=3))
def test_batch_round_trips_with_nested_groups(group_list: list[t.RolloutGroup]) -> None:
    batch = t.Batch(
        step=3,
        rank=0,
        groups=group_list,
        staleness=[g.versions.copy() for g in group_list],
        dropped_stale=2,
        dropped_no_signal=8,
        no_signal_reward_sum=-4.5999999940395355,
    )
    decoded, _ = decode([bytes(f) for f in encode(batch)])
    assert_equal(decoded, batch)


def test_a_batch_without_the_filter_counters_decodes_and_bad_ones_are_refused() -> None:
    """A buffer from before dynamic sampling sends no dropped_no_signal / no_signal_reward_sum: 0 and 0.0. A
    negative count or a non-finite sum is refused on decode."""
    group = next_group()
    fields = to_fields(t.Batch(step=1, rank=0, groups=[group], staleness=[group.versions.copy()], dropped_stale=3))
    old = {k: v for k, v in fields.items() if k not in ("dropped_no_signal", "no_signal_reward_sum")}
    decoded = from_fields(t.Batch, old)
    assert (decoded.dropped_stale, decoded.dropped_no_signal, decoded.no_signal_reward_sum) == (3, 0, 0.0)
    with pytest.raises(t.ContractError, match=r"dropped_no_signal: -1 is outside \[0, "):
        from_fields(t.Batch, {**old, "dropped_no_signal": -1})
    for bad in (math.nan, math.inf):
        with pytest.raises(t.ContractError, match="no_signal_reward_sum: must be finite"):
            from_fields(t.Batch, {**old, "no_signal_reward_sum": bad})


def test_payload_frames_are_returned_raw() -> None:
    header = wm.WeightsHeader(policy_version=1, tensors=[], bucket_sizes=[3, 2])
    message, payload = decode(encode(header, [b"abc", b"de"]))
    assert message == header and [bytes(p) for p in payload] == [b"abc", b"de"]


def test_decoded_arrays_are_read_only_views() -> None:
    group = next_group()
    decoded, _ = decode(encode(group))
    with pytest.raises(ValueError):
        decoded.completion_tokens[0] = 1


def next_group(n: int = 4, length: int = 16, seed: int = 0) -> t.RolloutGroup:
    rng = np.random.default_rng(seed)
    total = n * length
    return t.RolloutGroup(
        lease_id=1,
        prompt_id=2,
        epoch=0,
        generator_id=0,
        prompt_tokens=rng.integers(0, 49152, 12).astype(np.int32),
        offsets=np.arange(0, total + 1, length, dtype=np.int64),
        completion_tokens=rng.integers(0, 49152, total).astype(np.int32),
        behaviour_logprobs=-rng.random(total).astype(np.float32),
        loss_mask=np.ones(total, np.uint8),
        token_versions=np.zeros(total, np.int32),
        versions=np.zeros(n, np.int32),
        rewards=rng.random(n).astype(np.float32),
        finish_reasons=["stop"] * n,
    )


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=5))
def test_random_bytes_raise_only_wire_error(frames: list[bytes]) -> None:
    try:
        decode(frames)
    except WireError as error:
        assert error.reason and error.kind
    # decoding random bytes into a valid message is allowed only if it really is one (e.g. b'\x80...'), never a crash


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(MESSAGES, st.data())
def test_mutated_messages_raise_only_wire_error(message: object, data: st.DataObject) -> None:
    frames = [bytearray(bytes(f)) for f in encode(message)]
    index = data.draw(st.integers(0, len(frames) - 1))
    frame = frames[index]
    action = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop_frame", "add_frame"]))
    if action == "flip" and frame:
        pos = data.draw(st.integers(0, len(frame) - 1))
        frame[pos] ^= data.draw(st.integers(1, 255))
    elif action == "truncate":
        frames[index] = frame[: data.draw(st.integers(0, max(len(frame) - 1, 0)))]
    elif action == "extend":
        frame.extend(data.draw(st.binary(min_size=1, max_size=8)))
    elif action == "drop_frame":
        frames.pop(index)
    else:
        frames.append(bytearray(b"x"))
    try:
        decoded, _ = decode([bytes(f) for f in frames])
    except WireError:
        return
    # A mutation may still decode (e.g. a flipped reward byte); then it must be a fully valid message.
    assert type(decoded).WIRE_NAME in t.MESSAGE_TYPES
    if hasattr(decoded, "validate"):
        decoded.validate()


def header(**fields: object) -> bytes:
    return msgpack.packb({"p": t.PROTOCOL_VERSION, "t": "ok", "a": 0, "f": {"learner_version": 1}} | fields)


@pytest.mark.parametrize(
    ("frames", "kind"),
    [
        ([], "bad_frames"),
        ([header(p=t.PROTOCOL_VERSION + 1)], "wrong_version"),
        ([header(t="nope")], "unknown_type"),
        ([header(f={"learner_version": "1"})], "invalid_fields"),
        ([header(f={"learner_version": 1, "extra": 2})], "invalid_fields"),
        ([header(f={})], "invalid_fields"),
        ([header(a=3)], "bad_frames"),
        ([msgpack.packb([1, 2])], "garbage"),
        ([b"\x00" * 10], "garbage"),
    ],
)
def test_specific_rejections(frames: list[bytes], kind: str) -> None:
    with pytest.raises(WireError) as error:
        decode(frames)
    assert error.value.kind == kind


def test_oversized_message_is_rejected_before_parsing() -> None:
    frames = encode(next_group())
    with pytest.raises(WireError) as error:
        decode(frames, max_bytes=100)
    assert error.value.kind == "oversized"


def test_array_shape_must_match_frame() -> None:
    group = next_group()
    frames = [bytes(f) for f in encode(group)]
    frames[1] = frames[1] + b"\x00\x00\x00\x00"  # prompt_tokens frame one int32 longer than its shape
    with pytest.raises(WireError, match="bytes, shape needs"):
        decode(frames)


def test_misaligned_group_is_rejected() -> None:
    group = next_group()
    broken = dataclasses.replace(group, rewards=np.zeros(group.size + 1, np.float32))
    with pytest.raises(WireError, match="rewards"):
        decode(encode(broken))


def test_object_arrays_cannot_be_sent() -> None:
    group = dataclasses.replace(next_group(), prompt_tokens=np.array([object()]))
    with pytest.raises(TypeError):
        encode(group)


@pytest.mark.parametrize(
    "message",
    [
        t.VersionReport(policy_version=0, step=2**63),  # overflowed TensorBoard's int64 step (issue 12)
        t.VersionReport(policy_version=0, step=t.MAX_VERSION + 1),  # versions are int32 in groups and staleness
        t.VersionReport(policy_version=-1, step=0),
        t.LeaseRequest(generator_id=-5, max_prompts=1, policy_version=0),
        t.Heartbeat(generator_id=0, policy_version=0, lease_ids=[1, 2**53]),
        t.BatchRequest(step=0, rank=0, world_size=1, num_groups=2**64 - 1, timeout_s=1.0),
        t.BatchRequest(step=0, rank=0, world_size=1, num_groups=1, timeout_s=float("nan")),
        t.LeaseGrant(lease_id=1, deadline=float("inf"), prompts=[]),
        t.BufferStats(counters={"arrived": -(2**60)}, learner_version=0),
        wm.WeightsRequest(generator_id=0, have_version=-2),
    ],
)
def test_numbers_beyond_what_the_system_represents_are_rejected(message: object) -> None:
    with pytest.raises(WireError) as error:
        decode(encode(message))
    assert error.value.kind == "invalid_fields" and ("outside" in error.value.reason or "finite" in error.value.reason)
