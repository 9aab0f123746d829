"""Semantic checks of well-formed messages: group size and versions (including multi-turn groups whose
environment tokens carry version -1), and the bounds on lease and batch requests."""

from __future__ import annotations

import dataclasses

import numpy as np

from buffers.checks import batch_request_problem, group_problem, lease_request_problem, version_report_problem
from common.types import BatchRequest, LeaseRequest, VersionReport
from tests.buffers.fakes import make_group


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
    assert group_problem(make_group(1, (0, 0), size=4, version=[2, 3, 3, 2]), 4, newest_version=3) is None
    # environment tokens (mask 0, version -1) do not count; sample versions may be older than their tokens
    assert group_problem(_multi_turn([2, -1, 3, 1, 1, -1], [1, 0, 1, 1, 1, 0], [2, 0]), 2, newest_version=3) is None


def test_wrong_size_and_versions_out_of_range() -> None:
    assert group_problem(make_group(1, (0, 0), size=4), 8, 3)[0] == "wrong_group_size"
    assert group_problem(make_group(1, (0, 0), size=4, version=4), 4, newest_version=3)[0] == "future_version"
    assert group_problem(make_group(1, (0, 0), size=4, version=[0, -1, 0, 0]), 4, 3)[0] == "bad_version"


def test_a_sample_claiming_to_be_newer_than_its_tokens_is_rejected() -> None:
    # sample 1 says version 2 but holds a model token of version 1: its staleness would be understated
    kind, reason = group_problem(_multi_turn([2, 2, 2, 2, 1, -1], [1, 1, 1, 1, 1, 0], [2, 2]), 2, 3)
    assert kind == "bad_version" and reason.startswith("sample 1")
    all_model_tokens = dataclasses.replace(
        make_group(1, (0, 0), size=3, version=1), versions=np.array([1, 2, 1], np.int32)
    )
    kind, reason = group_problem(all_model_tokens, 3, 3)
    assert kind == "bad_version" and reason.startswith("sample 1")


def test_request_bounds() -> None:
    assert lease_request_problem(LeaseRequest(0, 4, 3), newest_version=3) is None
    assert lease_request_problem(LeaseRequest(0, 4, 4), newest_version=3)[0] == "future_version"
    assert batch_request_problem(BatchRequest(3, 1, 2, 4, 1.0), 100, learner_version=2, sync_every=1) is None
    assert batch_request_problem(BatchRequest(4, 1, 2, 4, 1.0), 100, learner_version=2, sync_every=1)[0] == "bad_step"
    assert batch_request_problem(BatchRequest(0, 0, 1, 4, 601.0), 100, 0, 1)[0] == "bad_timeout"
    assert version_report_problem(VersionReport(2, 2)) is None
    assert version_report_problem(VersionReport(-1, 0))[0] == "bad_version"
