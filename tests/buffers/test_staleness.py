"""The staleness rules alone: admission control (AReaL's rule) and the draw-time filter, on hand-worked numbers,
and a property: with FIFO consumption in admission order, admission alone keeps every sample within η."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers.staleness import admission_quota, admit, is_too_stale, sample_staleness, stale_positions


def test_quota_is_v_plus_eta_plus_one_batches_minus_admitted() -> None:
    # B = 4, η = 2, generator at v = 3: groups numbered < (3 + 2 + 1) * 4 = 24 may be admitted
    assert admission_quota(policy_version=3, max_staleness=2, groups_per_step=4, admitted=20) == 4
    assert admission_quota(policy_version=3, max_staleness=2, groups_per_step=4, admitted=24) == 0
    assert admission_quota(policy_version=0, max_staleness=0, groups_per_step=4, admitted=0) == 4  # η = 0: one batch


def test_admit_grants_at_most_the_quota() -> None:
    assert admit(8, policy_version=3, learner_version=4, max_staleness=2, groups_per_step=4, admitted=21).granted == 3
    assert admit(2, policy_version=3, learner_version=4, max_staleness=2, groups_per_step=4, admitted=0).granted == 2


def test_admit_refuses_full_when_the_quota_is_used() -> None:
    decision = admit(8, policy_version=3, learner_version=4, max_staleness=2, groups_per_step=4, admitted=24)
    assert (decision.granted, decision.refusal, decision.min_version) == (0, "full", 2)


def test_admit_refuses_stale_weights_and_names_the_version_to_load() -> None:
    # V = 7, η = 2: weights older than 5 are refused even with quota left
    decision = admit(8, policy_version=4, learner_version=7, max_staleness=2, groups_per_step=4, admitted=0)
    assert (decision.granted, decision.refusal, decision.min_version) == (0, "stale", 5)
    assert admit(8, policy_version=5, learner_version=7, max_staleness=2, groups_per_step=4, admitted=0).granted == 8


def test_eta_zero_is_synchronous_one_batch_per_version() -> None:
    assert admit(9, 0, 0, 0, groups_per_step=4, admitted=0).granted == 4
    assert admit(9, 0, 0, 0, groups_per_step=4, admitted=4).refusal == "full"
    assert admit(9, 0, 1, 0, groups_per_step=4, admitted=4).refusal == "stale"  # learner stepped: load v1
    assert admit(9, 1, 1, 0, groups_per_step=4, admitted=4).granted == 4


def test_admit_rejects_an_empty_request() -> None:
    with pytest.raises(ValueError, match="requested"):
        admit(0, 0, 0, 1, 4, 0)


def test_staleness_filter() -> None:
    versions = np.array([5, 3, 4], np.int32)
    assert sample_staleness(6, versions).tolist() == [1, 3, 2]
    assert sample_staleness(6, versions).dtype == np.int32
    assert not is_too_stale(step=6, oldest_version=4, max_staleness=2)
    assert is_too_stale(step=7, oldest_version=4, max_staleness=2)
    assert stale_positions(step=7, oldest_versions=[6, 4, 5, 2], max_staleness=2) == [1, 3]


@settings(max_examples=200, deadline=None)
@given(
    eta=st.integers(0, 3),
    batch=st.integers(1, 4),
    ops=st.lists(
        st.tuples(st.sampled_from(["lease", "sync", "learn"]), st.integers(0, 2), st.integers(1, 6)), max_size=120
    ),
)
def test_fifo_admission_alone_keeps_every_sample_within_eta(eta: int, batch: int, ops: list) -> None:
    """Three generators lease, load new weights at random moments; the learner trains B groups FIFO per step.
    With groups consumed in admission order, no group is ever trained more than η versions late."""
    learner = 0  # V
    versions = [0, 0, 0]  # weights each generator holds
    admitted: list[int] = []  # version of each admitted, not yet trained group, in admission order
    trained = 0
    for op, gen, count in ops:
        if op == "sync":
            versions[gen] = learner
        elif op == "lease":
            decision = admit(count, versions[gen], learner, eta, batch, trained + len(admitted))
            assert decision.granted <= count
            if decision.refusal == "stale":
                assert versions[gen] < learner - eta
            admitted += [versions[gen]] * decision.granted
        elif op == "learn" and len(admitted) >= batch:
            step_groups, admitted = admitted[:batch], admitted[batch:]
            assert all(learner - v <= eta for v in step_groups), (learner, step_groups)
            trained += batch
            learner += 1
