"""Group building and the prompt lifecycle (actors/groups.py): no engine, no sockets."""

from __future__ import annotations

import numpy as np
import pytest

from actors.engine.api import FinishedSample
from actors.groups import LeaseBook, PendingGroups, build_group, parse_request_id, sample_request_id
from actors.rewards.functions import Score
from common.types import LeaseGrant, RolloutGroup
from common.wire import decode, encode
from launch.testing import arithmetic_items


def _sample(request_id: str, length: int, versions: list[int] | None = None, start: int = 3) -> FinishedSample:
    tokens = np.arange(length, dtype=np.int32) + 100
    logprobs = -np.linspace(0.1, 1.0, length, dtype=np.float32)
    token_versions = np.asarray(versions if versions is not None else [start] * length, dtype=np.int32)
    return FinishedSample(request_id, tokens, logprobs, token_versions, "stop", start)


def test_request_ids_round_trip():
    assert parse_request_id(sample_request_id(12, 345, 6)) == (12, 345, 6)


def test_book_builds_a_group_when_all_samples_are_back_in_any_order():
    book, groups = LeaseBook(), PendingGroups(group_size=3)
    prompts = arithmetic_items(2)
    book.add_grant(LeaseGrant(lease_id=7, deadline=0.0, prompts=prompts))
    assert book.in_flight() == 2 and book.lease_ids() == [7]
    lease_id, prompt = book.take_queued()
    pending = groups.start(lease_id, prompt, [1, 2, 3])
    assert pending.request_ids == ["7:0:0", "7:0:1", "7:0:2"] == groups.request_ids()
    assert groups.record(_sample("7:0:2", 4)) is None
    assert groups.record(_sample("7:0:0", 2)) is None
    assert groups.record(_sample("9:9:0", 2)) is None  # a sample of no tracked group is ignored
    done = groups.record(_sample("7:0:1", 5))
    assert done is pending and done.complete and groups.request_ids() == []
    assert book.in_flight() == 2  # built only when the generator closes it
    book.close_prompt(7, 0)
    assert book.in_flight() == 1 and book.unfinished() == {7: [1]}
    book.close_prompt(7, 1)
    assert book.in_flight() == 0 and book.lease_ids() == []


def test_group_is_columnar_aligned_and_survives_the_wire():
    groups = PendingGroups(group_size=3)
    prompt = arithmetic_items(1)[0]
    pending = groups.start(5, prompt, [10, 11, 12, 13])
    samples = [_sample("5:0:0", 2), _sample("5:0:1", 0), _sample("5:0:2", 4, versions=[3, 3, 4, 4])]
    for sample in samples:
        groups.record(sample)
    scores = [
        Score(1.1, {"correct": 1.0, "format": 0.1}),
        Score(0.0, {"correct": 0.0}),
        Score(-1.0, {}, "ValueError: x"),
    ]
    group = build_group(pending, scores, generator_id=2)

    message, _ = decode(encode(group))  # validate() runs on decode: alignment holds
    assert isinstance(message, RolloutGroup) and message.group_id == (5, 0) and message.generator_id == 2
    assert message.offsets.tolist() == [0, 2, 2, 6]
    np.testing.assert_array_equal(message.completion_tokens, np.concatenate([s.completion_tokens for s in samples]))
    np.testing.assert_array_equal(message.behaviour_logprobs, np.concatenate([s.behaviour_logprobs for s in samples]))
    assert message.token_versions.tolist() == [3, 3, 3, 3, 4, 4]
    assert message.versions.tolist() == [3, 3, 3]  # the oldest version behind each sample
    assert message.loss_mask.tolist() == [1] * 6
    assert message.prompt_tokens.tolist() == [10, 11, 12, 13]
    assert message.rewards.tolist() == pytest.approx([1.1, 0.0, -1.0])
    assert message.reward_components["correct"].tolist() == [1.0, 0.0, 0.0]
    assert message.reward_components["format"].tolist() == pytest.approx([0.1, 0.0, 0.0])
    assert message.finish_reasons == ["stop", "stop", "env_error: reward: ValueError: x"]
    assert message.started_at <= message.finished_at


def test_incomplete_group_is_refused():
    prompt = arithmetic_items(1)[0]
    pending = PendingGroups(group_size=2).start(1, prompt, [1])
    pending.samples[0] = _sample("1:0:0", 1)
    with pytest.raises(ValueError, match="incomplete"):
        build_group(pending, [Score(0.0)], generator_id=0)
