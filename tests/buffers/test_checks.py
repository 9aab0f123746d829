"""Semantic checks of well-formed messages: group size and versions (including multi-turn groups whose
environment tokens carry version -1), and the bounds on lease and batch requests."""

from __future__ import annotations

import dataclasses

import numpy as np

from buffers.checks import (
    GroupLimits,
    batch_request_problem,
    group_problem,
    lease_request_problem,
    version_report_problem,
)
from common.types import BatchRequest, LeaseRequest, VersionReport
from tests.buffers.fakes import make_group


def limits(group_size: int) -> GroupLimits:
    return GroupLimits(group_size, vocab_size=1000, max_model_len=64, max_abs_reward=1e6)


def _multi_turn(token_versions: list[int], loss_mask: list[int], versions: list[int]):
    """Two samples of 3 tokens each with the given per-token versions and mask."""
    group = make_group(1, (0, 0), size=2, tokens=3)
    return dataclasses.replace(
        group,
        token_versions=np.array(token_versions, np.int32),
        loss_mask=np.array(loss_mask, np.uint8),
        behaviour_logprobs=np.where(np.array(loss_mask) == 1, group.behaviour_logprobs, 0).astype(np.float32),
        versions=np.array(versions, np.int32),
    )


def test_valid_groups_pass() -> None:
    assert group_problem(make_group(1, (0, 0), size=4, version=[2, 3, 3, 2]), limits(4), newest_version=3) is None
    # environment tokens (mask 0, version -1) do not count; sample versions may be older than their tokens
    assert (
        group_problem(_multi_turn([2, -1, 3, 1, 1, -1], [1, 0, 1, 1, 1, 0], [2, 0]), limits(2), newest_version=3)
        is None
    )


def test_wrong_size_and_versions_out_of_range() -> None:
    assert group_problem(make_group(1, (0, 0), size=4), limits(8), 3)[0] == "wrong_group_size"
    assert group_problem(make_group(1, (0, 0), size=4, version=4), limits(4), newest_version=3)[0] == "future_version"
    assert group_problem(make_group(1, (0, 0), size=4, version=[0, -1, 0, 0]), limits(4), 3)[0] == "bad_version"


def test_a_sample_claiming_to_be_newer_than_its_tokens_is_rejected() -> None:
    # sample 1 says version 2 but holds a model token of version 1: its staleness would be understated
    kind, reason = group_problem(_multi_turn([2, 2, 2, 2, 1, -1], [1, 1, 1, 1, 1, 0], [2, 2]), limits(2), 3)
    assert kind == "bad_version" and reason.startswith("sample 1")
    all_model_tokens = dataclasses.replace(
        make_group(1, (0, 0), size=3, version=1), versions=np.array([1, 2, 1], np.int32)
    )
    kind, reason = group_problem(all_model_tokens, limits(3), 3)
    assert kind == "bad_version" and reason.startswith("sample 1")


def test_request_bounds() -> None:
    assert lease_request_problem(LeaseRequest(0, 4, 3), newest_version=3) is None
    assert lease_request_problem(LeaseRequest(0, 4, 4), newest_version=3)[0] == "future_version"
    assert batch_request_problem(BatchRequest(3, 1, 2, 4, 1.0), 100, learner_version=2, sync_every=1) is None
    assert batch_request_problem(BatchRequest(4, 1, 2, 4, 1.0), 100, learner_version=2, sync_every=1)[0] == "bad_step"
    assert batch_request_problem(BatchRequest(0, 0, 1, 4, 601.0), 100, 0, 1)[0] == "bad_timeout"
    assert version_report_problem(VersionReport(2, 2)) is None
    assert version_report_problem(VersionReport(-1, 0))[0] == "bad_version"


def _with(group, **arrays):
    return dataclasses.replace(group, **{k: v if not isinstance(v, list) else np.array(v) for k, v in arrays.items()})


def test_content_outside_what_a_learner_can_train_on_is_rejected_by_kind() -> None:
    good = make_group(1, (0, 0), size=2, tokens=3)  # prompt of 5 tokens, samples of 3 tokens, ids < 1000
    f32, i32 = np.float32, np.int32
    cases = {
        "empty_prompt": _with(good, prompt_tokens=np.zeros(0, i32)),
        "too_long": _with(good, prompt_tokens=np.zeros(62, i32)),  # 62 + 3 > max_model_len 64
        "empty_completion": _with(
            good,
            offsets=np.zeros(3, np.int64),
            completion_tokens=np.zeros(0, i32),
            behaviour_logprobs=np.zeros(0, f32),
            loss_mask=np.zeros(0, np.uint8),
            token_versions=np.zeros(0, i32),
        ),
        "bad_token": _with(good, completion_tokens=np.array([0, 1, 1000, 3, 4, 5], i32)),  # vocab_size 1000
        "bad_reward": _with(good, rewards=np.array([3e38, 0], f32)),
        "bad_logprob": _with(good, behaviour_logprobs=np.array([-1, 0.5, -1, -1, -1, -1], f32)),
        "future_version": _with(good, token_versions=np.array([0, 0, 9, 0, 0, 0], i32)),
        "too_large": dataclasses.replace(good, finish_reasons=["stop", "x" * 5000]),
    }
    for kind, group in cases.items():
        problem = group_problem(group, limits(2), newest_version=3)
        assert problem is not None and problem[0] == kind, (kind, problem)
    negative_prompt = _with(good, prompt_tokens=np.array([-1, 2], i32))
    assert group_problem(negative_prompt, limits(2), 3)[0] == "bad_token"
    for value in (np.nan, np.inf, -2e6):
        component = dataclasses.replace(good, reward_components={"format": np.array([0, value], f32)})
        assert group_problem(component, limits(2), 3)[0] == "bad_reward", value
    for value in (np.nan, -np.inf):
        logprobs = good.behaviour_logprobs.copy()
        logprobs[4] = value
        assert group_problem(_with(good, behaviour_logprobs=logprobs), limits(2), 3)[0] == "bad_logprob", value
    # at the bounds: prompt + completion = max_model_len, ids 0 and vocab - 1, |reward| = max_abs_reward, log-prob 0
    edge = _with(
        good,
        prompt_tokens=np.full(61, 999, i32),
        completion_tokens=np.array([0, 999, 5, 6, 7, 8], i32),
        rewards=np.array([1e6, -1e6], f32),
        behaviour_logprobs=np.array([0, -30, -1, -1, -1, -1], f32),
    )
    assert group_problem(edge, limits(2), 3) is None
    one_empty_sample = _with(make_group(1, (0, 0), size=2, tokens=3), offsets=np.array([0, 0, 6], np.int64))
    assert group_problem(one_empty_sample, limits(2), 3) is None  # an episode that ended before its first turn
