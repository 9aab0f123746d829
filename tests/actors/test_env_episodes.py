"""The episode driver on a scripted engine with SmolLM2's real chat template: token-exact trajectories, limits.

The property test draws random episode shapes (turn counts, observations, rewards, end-of-turn or not, limits) and
checks every trajectory token by token against what the engine was asked and what it sampled:
  * model tokens (loss_mask 1) are exactly the sampled ids, in order, with their log-probs and versions;
  * each turn's prompt is exactly the trajectory so far; environment tokens (loss_mask 0, log-prob 0, version -1)
    are the chat-template delta of the scripted observation, with exactly one <|im_end|> closing the model's turn;
  * the environment was given exactly the decoded text of each turn; rewards and finish reasons follow the rules.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from actors.environments.episodes import EpisodeDriver, EpisodeLimits
from actors.environments.runner import EnvRunner
from actors.environments.trajectory import build_episode_group
from common.types import PromptItem, RolloutGroup
from launch.testing import drive_until_done
from tests.actors.env_fakes import ScriptedEngine, ScriptedEnv, ScriptedFactory, Turn

TASK = PromptItem(prompt_id=7, epoch=0, messages=[{"role": "user", "content": "Guess my number."}], metadata={})


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def runner():
    runner = EnvRunner(workers=8)
    yield runner
    runner.close()


def limits(**overrides) -> EpisodeLimits:
    values = {
        "max_turns": 8,
        "max_total_tokens": 4096,
        "turn_max_tokens": 8,
        "max_model_len": 8192,
        "step_timeout_s": 5.0,
        "episode_timeout_s": 30.0,
        "failure_reward": -1.0,
    }
    values.update(overrides)
    return EpisodeLimits(**values)


def run_group(engine, envs: list[ScriptedEnv], runner, bounds: EpisodeLimits) -> RolloutGroup:
    driver = EpisodeDriver(engine, ScriptedFactory(envs), bounds, runner, group_size=len(envs))
    driver.start_group(lease_id=3, prompt=TASK)
    (group,) = drive_until_done(driver, timeout_s=30)
    built = build_episode_group(group.lease_id, group.prompt, group.results, generator_id=0, started_at=0.0)
    built.validate()
    return built


def check_sample(group: RolloutGroup, i: int, engine: ScriptedEngine, env: ScriptedEnv, bounds: EpisodeLimits):
    """Every invariant of the module docstring for sample i; returns (its turn requests, its own token count)."""
    span = slice(int(group.offsets[i]), int(group.offsets[i + 1]))
    completion, mask = group.completion_tokens[span], group.loss_mask[span]
    logprobs, versions = group.behaviour_logprobs[span], group.token_versions[span]
    sequence = group.prompt_tokens.tolist() + completion.tolist()
    start = len(group.prompt_tokens)
    requests = sorted(
        (r for rid, r in engine.requests.items() if rid.startswith(f"3:7:{i}:")),
        key=lambda r: int(r.request_id.rsplit(":", 1)[1]),
    )
    assert env.texts == [engine.decode(np.asarray(r.tokens)) for r in requests]
    first = engine.render(TASK if env.first is None else PromptItem(7, 0, [{"role": "user", "content": env.first}], {}))
    assert sequence[: len(first)] == first
    model_positions = []
    for turn, request in enumerate(requests):
        at = len(request.prompt)
        assert sequence[:at] == request.prompt, f"turn {turn}'s prompt is not the trajectory so far"
        assert sequence[at : at + len(request.tokens)] == request.tokens, "sampled tokens changed"
        model_positions.extend(range(at - start, at - start + len(request.tokens)))
        np.testing.assert_array_equal(
            logprobs[at - start : at - start + len(request.tokens)], np.asarray(request.logprobs, np.float32)
        )
        np.testing.assert_array_equal(versions[at - start : at - start + len(request.tokens)], request.versions)
        end = at + len(request.tokens)
        if turn + 1 < len(requests):
            following = sequence[end : len(requests[turn + 1].prompt)]
            assert following == engine.render_turn(np.asarray(request.tokens), env.observations[turn])
            im_end = engine.turns.end_of_turn_id()
            im_start = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
            between = request.tokens[-1:] + following[: following.index(im_start)]
            assert between.count(im_end) == 1, "the model's turn must be closed by exactly one <|im_end|>"
        assert request.max_tokens <= bounds.turn_max_tokens
    expected_mask = np.zeros(len(completion), np.uint8)
    expected_mask[model_positions] = 1
    np.testing.assert_array_equal(mask, expected_mask)
    assert np.all(logprobs[mask == 0] == 0) and np.all(versions[mask == 0] == -1)
    own_tokens = len(sequence) - len(first)  # the episode's completion, without the group-prompt remainder
    assert own_tokens <= bounds.max_total_tokens
    return requests, own_tokens


episode_script = st.lists(
    st.tuples(
        st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=0, max_size=30),
        st.floats(-2, 2, allow_nan=False, width=32),
    ),
    min_size=1,
    max_size=5,
).map(
    lambda turns: (
        [Turn(obs=text or "?", reward=reward) for text, reward in turns[:-1]] + [Turn(reward=turns[-1][1], done=True)]
    )
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    scripts=st.lists(episode_script, min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
    max_turns=st.integers(1, 6),
    max_total_tokens=st.integers(1, 80),
    turn_max_tokens=st.integers(1, 12),
    eos=st.floats(0, 1),
    firsts=st.lists(st.sampled_from([None, "Hi", "Start!"]), min_size=4, max_size=4),
)
def test_random_episodes_are_token_exact(
    tokenizer, runner, scripts, seed, max_turns, max_total_tokens, turn_max_tokens, eos, firsts
) -> None:
    engine = ScriptedEngine(tokenizer, seed=seed, eos_probability=eos, max_tokens=turn_max_tokens)
    envs = [ScriptedEnv(script, first=first) for script, first in zip(scripts, firsts)]
    bounds = limits(max_turns=max_turns, max_total_tokens=max_total_tokens, turn_max_tokens=turn_max_tokens)
    group = run_group(engine, envs, runner, bounds)
    for i, (env, script) in enumerate(zip(envs, scripts)):
        requests, own_tokens = check_sample(group, i, engine, env, bounds)
        reason, turns = group.finish_reasons[i], len(requests)
        event(reason)
        assert turns <= max_turns
        done_turn = len(script)  # the scripted step that says done
        if reason in ("done", "length"):
            assert turns == done_turn
            assert (reason == "length") == (
                engine.requests[requests[-1].request_id].length == requests[-1].max_tokens
                and not requests[-1].ends_turn
            )
            expected = sum(t.reward for t in script)
        elif reason == "max_turns":
            assert turns == max_turns < done_turn
            expected = sum(t.reward for t in script[:turns])
        else:
            assert reason == "max_total_tokens", reason
            assert turns < done_turn
            unplaced = engine.render_turn(np.asarray(requests[-1].tokens), env.observations[turns - 1])
            assert own_tokens + len(unplaced) + 1 > max_total_tokens, "the observation would have fitted"
            expected = sum(t.reward for t in script[:turns])
        # rewards are float32: the sum of <= 5 turn rewards, its storage and the final addition round each by
        # <= eps_f32 / 2 of sum |r| (the terms may cancel): (turns + 2) eps_f32 sum |r| holds with 2x to spare
        atol = (len(script) + 2) * float(np.finfo(np.float32).eps) * sum(abs(t.reward) for t in script)
        assert group.rewards[i] == pytest.approx(expected, rel=0, abs=atol)
        components = {name: float(values[i]) for name, values in group.reward_components.items()}
        assert components["failure"] == 0.0
        assert components["turn_reward_sum"] + components["terminal"] == pytest.approx(expected, rel=0, abs=atol)
    deadline = time.monotonic() + 5  # close() is submitted to the runner, not waited for
    while not all(env.closed for env in envs) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert all(env.closed for env in envs)


def test_versions_change_mid_episode_and_the_sample_keeps_the_oldest(tokenizer, runner) -> None:
    engine = ScriptedEngine(tokenizer, seed=1, eos_probability=0.0, max_tokens=4)
    env = ScriptedEnv([Turn(obs="more"), Turn(obs="more"), Turn(done=True, reward=1.0)])
    driver = EpisodeDriver(engine, ScriptedFactory([env]), limits(), runner, group_size=1)
    driver.start_group(3, TASK)
    groups = []
    while driver.active():
        groups += driver.advance()
        if engine.num_unfinished():
            engine.policy_version += 1  # a new version every step (in-flight loads)
            for sample in engine.step():
                driver.on_turn(sample)
        else:
            driver.wait(0.01)
    group = build_episode_group(3, TASK, groups[0].results, 0, 0.0)
    model = group.token_versions[group.loss_mask == 1]
    assert len(set(model.tolist())) > 2 and np.all(np.diff(model) > 0)
    assert group.versions[0] == model.min()
    assert np.all(group.token_versions[group.loss_mask == 0] == -1)


def test_group_prompt_is_the_common_prefix_of_different_first_observations(tokenizer, runner) -> None:
    engine = ScriptedEngine(tokenizer, seed=2)
    envs = [ScriptedEnv([Turn(done=True)], first=text) for text in ("Secret is high.", "Secret is low.", None)]
    group = run_group(engine, envs, runner, limits())
    firsts = [
        engine.render(PromptItem(7, 0, [{"role": "user", "content": t}], {}))
        for t in ("Secret is high.", "Secret is low.")
    ]
    firsts.append(engine.render(TASK))
    for i, first in enumerate(firsts):
        span = slice(int(group.offsets[i]), int(group.offsets[i + 1]))
        sequence = group.prompt_tokens.tolist() + group.completion_tokens[span].tolist()
        assert sequence[: len(first)] == first
        assert np.all(group.loss_mask[span][: len(first) - len(group.prompt_tokens)] == 0)
    assert 0 < len(group.prompt_tokens) < min(len(f) for f in firsts)


def test_a_reward_the_buffer_would_refuse_fails_only_its_own_episode(tokenizer, runner) -> None:
    """Each turn within the bound, the sum past it; one turn past it; a float64 reward that is inf in float32:
    those episodes are env_error with the failure reward, and the group (the fine episode included) is valid."""
    engine = ScriptedEngine(tokenizer, seed=4)
    envs = [
        ScriptedEnv([Turn(reward=0.75, done=True)]),
        ScriptedEnv([Turn(reward=6e5), Turn(reward=6e5, done=True)]),  # 1.2e6 in total, over 1e6
        ScriptedEnv([Turn(reward=1e39, done=True)]),
    ]
    group = run_group(engine, envs, runner, limits(max_abs_reward=1e6))
    assert group.rewards.tolist() == [0.75, -1.0, -1.0]
    assert group.finish_reasons[0] == "done"
    assert group.finish_reasons[1].startswith("env_error: reward total 1.2e+06 outside [-1e+06, 1e+06]")
    assert group.finish_reasons[2].startswith("env_error: reward terminal 1e+39 outside")


def test_declared_tools_join_the_first_observation_and_a_bad_list_is_an_env_error(tokenizer, runner) -> None:
    """An environment's `tools` attribute puts the Hermes tools block into the system message of its first
    observation (a new first system message here: the task has none); a malformed list fails that episode."""
    from common.tool_calls import tools_system_prompt, with_tools

    tools = [{"type": "function", "function": {"name": "calculate", "parameters": {"type": "object"}}}]
    engine = ScriptedEngine(tokenizer, seed=5)
    envs = [ScriptedEnv([Turn(reward=1.0, done=True)]) for _ in range(3)]
    envs[0].tools = tools
    envs[1].tools = [{"type": "function", "function": {"name": "two words"}}]
    group = run_group(engine, envs, runner, limits())
    (first_request,) = [r for rid, r in engine.requests.items() if rid.startswith("3:7:0:")]
    expected = with_tools(TASK.messages, tools)
    assert expected[0] == {"role": "system", "content": tools_system_prompt(tools)}
    assert first_request.prompt == engine.render(PromptItem(7, 0, expected, {}))
    (plain_request,) = [r for rid, r in engine.requests.items() if rid.startswith("3:7:2:")]
    assert plain_request.prompt == engine.render(TASK)
    assert group.finish_reasons[0] == "done" and group.finish_reasons[2] == "done"
    assert group.finish_reasons[1].startswith("env_error: reset: tools[0].function.name must match")
    assert group.rewards.tolist() == [1.0, -1.0, 1.0]


def test_an_environments_process_metrics_join_the_drivers_and_a_raising_one_is_skipped(tokenizer, runner) -> None:
    """common.envs: a factory carrying `process_metrics` (the environment class's) has its counts in every report."""
    engine = ScriptedEngine(tokenizer, seed=1, eos_probability=0.0, max_tokens=4)
    factory = ScriptedFactory([])
    factory.process_metrics = lambda: {"env/endpoint_refused": 3.0}  # type: ignore[attr-defined]
    driver = EpisodeDriver(engine, factory, limits(), runner, group_size=1)
    assert driver.metrics()["env/endpoint_refused"] == 3.0
    factory.process_metrics = lambda: 1 / 0  # type: ignore[attr-defined]
    assert "env/endpoint_refused" not in driver.metrics() and "env/loop_blocks" in driver.metrics()


def test_answered_environment_calls_count_as_progress(tokenizer, runner) -> None:
    """The driver counts the environment calls it took in (reset + every step): a generator's heartbeat reports them
    as progress, so one waiting only on slow environment calls is not taken for stuck (actors.liveness)."""
    engine = ScriptedEngine(tokenizer, seed=1, eos_probability=0.0, max_tokens=4)
    env = ScriptedEnv([Turn(obs="more"), Turn(obs="more"), Turn(done=True, reward=1.0)])
    driver = EpisodeDriver(engine, ScriptedFactory([env]), limits(), runner, group_size=1)
    driver.start_group(3, TASK)
    drive_until_done(driver, timeout_s=30)
    assert driver.calls_answered == 1 + 3  # reset, then three steps
