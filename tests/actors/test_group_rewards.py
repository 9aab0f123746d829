"""A group's rewards (actors/rewards/groups.py): weighted sources, raw components, fallbacks per source."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from actors.rewards.functions import Score
from actors.rewards.groups import REWARD_MODEL, GroupRewards, combine
from launch.testing import free_port, run_config
from tests.actors.reward_models import make_tiny_reward_model

VERIFIER = [Score(1.2, {"correct": 1.0, "format": 0.2}), Score(0.0, {"correct": 0.0, "format": 0.0})]


def test_weight_zero_components_are_recorded_and_add_nothing():
    scores = combine(2, VERIFIER, [0.5, -1.5], "", function_weight=0.0, model_weight=2.0, fallback=0.0)
    assert [s.reward for s in scores] == [1.0, -3.0]  # 2 x the RM score; the verifier's weight is 0
    assert scores[0].components == {"correct": 1.0, "format": 0.2, REWARD_MODEL: 0.5}  # raw, unweighted
    assert scores[1].components == {"correct": 0.0, "format": 0.0, REWARD_MODEL: -1.5}
    assert all(s.error is None for s in scores)


def test_the_scalar_reward_is_the_weighted_sum_of_both_sources():
    scores = combine(2, VERIFIER, [0.5, -1.5], "", function_weight=0.5, model_weight=0.25, fallback=0.0)
    assert [s.reward for s in scores] == pytest.approx([0.5 * 1.2 + 0.25 * 0.5, 0.5 * 0.0 + 0.25 * -1.5])


def test_a_reward_model_that_fell_back_gives_the_fallback_component_and_says_why():
    scores = combine(2, VERIFIER, None, "no reply within 60s", function_weight=1.0, model_weight=1.0, fallback=-0.5)
    assert [s.components[REWARD_MODEL] for s in scores] == [-0.5, -0.5]
    assert [s.reward for s in scores] == pytest.approx([1.2 - 0.5, -0.5])
    assert all(s.error == "reward_model: no reply within 60s" for s in scores)


def test_the_reward_model_alone_and_the_function_alone():
    alone = combine(1, None, [0.75], "", function_weight=1.0, model_weight=1.0, fallback=0.0)
    assert alone == [Score(0.75, {REWARD_MODEL: 0.75})]
    fallen = combine(3, None, None, "down", function_weight=1.0, model_weight=1.0, fallback=0.1)
    assert [s.reward for s in fallen] == [0.1, 0.1, 0.1]
    assert combine(2, VERIFIER, None, "", 1.0, 1.0, 0.0) == VERIFIER  # no reward model: what the function gave
    with pytest.raises(ValueError, match="2 samples"):
        combine(2, VERIFIER, [0.5], "", 1.0, 1.0, 0.0)


def test_in_process_scoring_records_the_verifier_beside_the_reward_model(tiny_model_dir: Path, tmp_path: Path):
    rm = make_tiny_reward_model(tiny_model_dir, tmp_path / "rm", seed=3)
    config = run_config(
        tmp_path / "runs",
        "in-process",
        env={"reward_model": str(rm), "reward_fn_weight": 0.0},
        reward={"in_process": True, "weight": 1.0},
    )
    rewards = GroupRewards.from_config(config, "generator-0")
    prompt = [{"role": "user", "content": "What is 3 + 4?"}]
    rewards.submit("g", prompt, ["#### 7", "#### 9"], {"answer": 7}, time.monotonic())
    [(key, scores)] = rewards.finished(time.monotonic())
    model = rewards.model.score_group(prompt, ["#### 7", "#### 9"])
    assert key == "g" and [s.reward for s in scores] == pytest.approx(model)  # the verifier adds nothing ...
    assert [s.components["correct"] for s in scores] == [1.0, 0.0]  # ... and is recorded
    assert rewards.metrics()["actor/reward_model_fallbacks"] == 0 and rewards.pending() == 0


def test_a_service_that_is_not_there_gives_the_fallback_after_the_timeout(tmp_path: Path):
    config = run_config(
        tmp_path / "runs",
        "no-service",
        env={"reward_model": str(tmp_path / "rm"), "failure_reward": -1.0},
        reward={"port": free_port(), "timeout_s": 0.5},
    )
    rewards = GroupRewards.from_config(config, "generator-0")
    started = time.monotonic()
    rewards.submit("g", [{"role": "user", "content": "What is 1 + 1?"}], ["#### 2"], {"answer": 2}, started)
    assert rewards.finished(started) == [] and rewards.pending() == 1  # waiting, not blocking
    [(key, [score])] = rewards.finished(started + 0.5)
    assert key == "g"
    assert score.components[REWARD_MODEL] == -1.0 and score.components["correct"] == 1.0
    assert "unreachable" in score.error and rewards.metrics()["actor/reward_model_fallbacks"] == 1
    rewards.close()
