"""The guard that stops a generator whose reward fails on most samples (actors/rewards/failure_guard.py): its line by hand,
and through the rollout seam with a reward function that always raises."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from actors.engine.simulated import SimEngine
from actors.rewards.failure_guard import MIN_SAMPLES, WINDOW_SAMPLES, FailureGuard, GuardedRollouts, RewardsFailing
from actors.rollouts import rollouts_maker
from launch.testing import arithmetic_items, run_config

FAILED, OK = "env_error: reward: ValueError: metadata['answer'] = '#### 72' is not a number", "stop"


def _group(prompt_id: int, *reasons: str) -> SimpleNamespace:
    return SimpleNamespace(prompt_id=prompt_id, finish_reasons=list(reasons))  # what the guard reads of a group


def test_trips_only_past_the_share_once_min_samples_are_in():
    guard = FailureGuard(0.5)
    for prompt in range(MIN_SAMPLES // 2 - 1):  # 31 groups of 2 failures: 62 samples, all failed, under the minimum
        guard.check(_group(prompt, FAILED, FAILED))
    with pytest.raises(RewardsFailing, match=r"failed on 64 of the last 64 samples .* prompt 99: env_error: reward"):
        guard.check(_group(99, FAILED, FAILED))


def test_half_failed_is_not_most_and_timeouts_are_not_failures():
    guard = FailureGuard(0.5)
    for prompt in range(WINDOW_SAMPLES):  # exactly half failed (not more), the other half slow tools
        guard.check(_group(prompt, FAILED, "env_timeout"))
    assert guard.failed == WINDOW_SAMPLES and guard.seen == 2 * WINDOW_SAMPLES
    with pytest.raises(RewardsFailing):
        guard.check(_group(1, FAILED, FAILED))  # now 257 of the last 512


def test_a_burst_under_half_the_window_is_survived_and_forgotten():
    guard = FailureGuard(0.5)
    for prompt in range(400):  # a good start ...
        guard.check(_group(prompt, OK))
    for prompt in range(200):  # ... a burst of 200 failures: 200 of the last 512 (39%), survived ...
        guard.check(_group(prompt, FAILED))
    assert guard.failed_in_window == 200
    for prompt in range(WINDOW_SAMPLES):  # ... and forgotten after a window of good ones
        guard.check(_group(prompt, OK))
    assert guard.failed_in_window == 0 and len(guard.recent) == WINDOW_SAMPLES and guard.failed == 200


def test_share_one_never_trips_and_bad_shares_are_refused():
    guard = FailureGuard(1.0)
    for prompt in range(WINDOW_SAMPLES):
        guard.check(_group(prompt, FAILED))
    with pytest.raises(ValueError, match="share must be in"):
        FailureGuard(1.5)


def _drive_until_stopped(tmp_path, share: float) -> tuple[GuardedRollouts, list, Exception | None]:
    config = run_config(
        tmp_path / "runs",
        "guard",
        run={"simulate": True},
        algo={"group_size": 4},
        env={"reward_fn": "tests.actors.reward_fns:explode_or_length", "stop_failure_share": share},
        generator={"sim_tokens": 2},
    )
    engine = SimEngine(2, 0.0, max_num_seqs=64, seed=0)
    rollouts = rollouts_maker(config, generator_id=0)(engine)
    for prompt in arithmetic_items(40, explode_every=1):  # every prompt makes the reward function raise
        assert rollouts.start(lease_id=1, prompt=prompt)
    groups, deadline = [], time.monotonic() + 60
    try:
        while rollouts.active():
            assert time.monotonic() < deadline
            for sample in engine.step():
                rollouts.on_sample(sample)
            groups.extend(rollouts.finished(time.monotonic()))
    except RewardsFailing as error:
        return rollouts, groups, error
    return rollouts, groups, None


def test_a_reward_that_always_raises_stops_the_rollouts_with_its_error(tmp_path):
    rollouts, groups, error = _drive_until_stopped(tmp_path, 0.5)
    assert isinstance(rollouts, GuardedRollouts) and error is not None
    assert "RuntimeError: reward exploded on purpose" in str(error)
    assert len(groups) * 4 < MIN_SAMPLES  # the groups of the tripping call are not handed on
    assert rollouts.metrics()["actor/reward_failed_samples"] >= MIN_SAMPLES
    rollouts.close()


def test_share_one_leaves_the_rollouts_unguarded(tmp_path):
    rollouts, groups, error = _drive_until_stopped(tmp_path, 1.0)
    assert error is None and not isinstance(rollouts, GuardedRollouts) and len(groups) == 40
    rollouts.close()
