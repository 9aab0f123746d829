"""verifiers environments through Tandem's episode driver (actors/environments/verifiers_env.py), on a scripted engine with a
real chat template: the example env (examples/verifiers_env/arith_feedback.py) runs multi-turn with exact tokens
and masks, its rubric's components reach the reward, and a raising env ends its episode as env_error.

Skipped when verifiers is not installed (scripts/setup.sh installs it: the verifiers extra).
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verifiers.v1", reason="verifiers is not installed (the verifiers extra; scripts/setup.sh)")

from actors.environments.episodes import EpisodeDriver, EpisodeLimits
from actors.environments.runner import EnvRunner
from actors.environments.trajectory import build_episode_group
from common.config import EnvConfig
from common.envs import environment_factory
from common.types import PromptItem, RolloutGroup
from launch.testing import drive_until_done
from tests.actors.env_fakes import ScriptedEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "verifiers_env"
RETRY = "Not quite. Try again: reply with just the number."
TASK_1 = "What is 2 + 9? Reply with just the number."  # arith-feedback's task 1 (seed 0): the answer is 11


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def runner():
    runner = EnvRunner(workers=4)
    yield runner
    runner.close()


class TextEngine(ScriptedEngine):
    """Answers episode i's turns with `answers[i]`, in order: each text's tokens, then <|im_end|>."""

    def __init__(self, tokenizer, answers: list[list[str]]) -> None:
        super().__init__(tokenizer, seed=0)
        self.answers = [list(texts) for texts in answers]

    def step(self):
        finished = []
        for request in list(self.running.values()):
            episode = int(request.request_id.split(":")[2])
            text = self.answers[episode].pop(0)
            request.tokens = self.tokenizer.encode(text, add_special_tokens=False) + [self.turns.end_of_turn_id()]
            request.logprobs = [-0.5] * len(request.tokens)
            request.versions = [self.policy_version] * len(request.tokens)
            request.length = len(request.tokens)
            request.ends_turn = True
            self.running.pop(request.request_id)
            finished.append(self._finished(request))
        return finished

    @staticmethod
    def _finished(request):
        from actors.engine.api import FinishedSample

        return FinishedSample(
            request.request_id,
            np.asarray(request.tokens, np.int32),
            np.asarray(request.logprobs, np.float32),
            np.asarray(request.versions, np.int32),
            "stop",
            request.start_version,
        )


def limits() -> EpisodeLimits:
    return EpisodeLimits(
        max_turns=5,
        max_total_tokens=512,
        turn_max_tokens=16,
        max_model_len=2048,
        step_timeout_s=10.0,
        episode_timeout_s=60.0,
        failure_reward=-1.0,
    )


def run_group(engine, factory, runner, prompt: PromptItem, n: int) -> RolloutGroup:
    driver = EpisodeDriver(engine, factory, limits(), runner, group_size=n)
    driver.start_group(lease_id=3, prompt=prompt)
    (group,) = drive_until_done(driver, timeout_s=60)
    built = build_episode_group(group.lease_id, group.prompt, group.results, generator_id=0, started_at=0.0)
    built.validate()
    return built


def example_factory():
    env = EnvConfig(
        environment="verifiers:arith-feedback", environment_args={"num_tasks": 4}, plugin_paths=[str(EXAMPLE)]
    )
    return environment_factory(env)  # the `verifiers:` prefix resolves actors.environments.verifiers_env at run time


def test_a_verifiers_env_runs_multi_turn_token_exact_and_its_rubric_is_the_reward(tokenizer, runner) -> None:
    """Three episodes of task 1 (2 + 9): right at the second answer, at the first, never (three bare numbers).
    Each trajectory is the hand-rendered chat: the prompt, the sampled ids (mask 1), the env's "Not quite" turn as
    a chat-template delta (mask 0); the components are the rubric's, score * weight (halves and quarters: exact in
    binary floating point, so compared exactly)."""
    answers = [["It is 12", "11"], ["11"], ["5", "6", "7"]]
    engine = TextEngine(tokenizer, answers)
    prompt = PromptItem(prompt_id=7, epoch=0, messages=[{"role": "user", "content": TASK_1}], metadata={"vf_idx": 1})
    group = run_group(engine, example_factory(), runner, prompt, n=3)

    assert list(group.finish_reasons) == ["done", "done", "done"]
    first = engine.render(prompt)
    assert group.prompt_tokens.tolist() == first
    for i, texts in enumerate(answers):
        expected, mask = [], []
        for turn, text in enumerate(texts):
            sampled = tokenizer.encode(text, add_special_tokens=False) + [engine.turns.end_of_turn_id()]
            expected += sampled
            mask += [1] * len(sampled)
            if turn + 1 < len(texts):
                delta = engine.render_turn(np.asarray(sampled), [{"role": "user", "content": RETRY}])
                expected += delta
                mask += [0] * len(delta)
        span = slice(int(group.offsets[i]), int(group.offsets[i + 1]))
        assert group.completion_tokens[span].tolist() == expected, f"episode {i}: tokens differ"
        assert group.loss_mask[span].tolist() == mask, f"episode {i}: mask differs"
    components = {name: values.tolist() for name, values in group.reward_components.items()}
    assert components["correct"] == [0.5, 1.0, 0.0]  # 0.5 ** (attempt index), weight 1
    assert components["bare_number"] == [0.25, 0.5, 0.5]  # the bare-integer share of the replies, weight 0.5
    assert components["terminal"] == [0.0, 0.0, 0.0]  # the rubric accounts for the whole final reward
    assert group.rewards.tolist() == [0.75, 1.5, 0.5]


BROKEN = """
import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def score_it(self, trace: vf.Trace) -> float:
        if "boom" in trace.last_reply:
            raise RuntimeError("the rubric exploded")
        if "interrupt" in trace.last_reply:
            raise KeyboardInterrupt("the rubric interrupted")
        if "exit" in trace.last_reply:
            raise SystemExit(3)
        return 1.0


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        return [BrokenTask(vf.TaskData(prompt="Say something."), self.config.task)]


class BrokenEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"})


class BrokenEnv(vf.Env[BrokenEnvConfig]):
    async def run(self, task, agents):
        trace = await agents.agent.run(task)
        if "crash" in trace.last_reply:
            raise ValueError("run() gave up")


__all__ = ["BrokenEnv", "BrokenTaskset"]
"""


def test_a_raising_verifiers_env_fails_only_its_own_episode(tokenizer, runner, tmp_path) -> None:
    """A rubric that raises, or an Env.run that raises, ends that episode as env_error with env.failure_reward;
    the group's other episode is scored (1.0). Also one-turn `agent.run(task)` (a SingleAgent-style run)."""
    (tmp_path / "tandem_vf_broken.py").write_text(textwrap.dedent(BROKEN))
    env = EnvConfig(environment="verifiers:tandem-vf-broken", plugin_paths=[str(tmp_path)])
    try:
        factory = environment_factory(env)
        engine = TextEngine(tokenizer, [["fine"], ["boom"], ["crash"]])
        prompt = PromptItem(7, 0, [{"role": "user", "content": "Say something."}], {"vf_idx": 0})
        group = run_group(engine, factory, runner, prompt, n=3)
    finally:
        sys.modules.pop("tandem_vf_broken", None)
    reasons = list(group.finish_reasons)
    assert reasons[0] == "done" and group.rewards[0] == 1.0
    assert reasons[1].startswith("env_error: step: ") and "the rubric exploded" in reasons[1]
    assert reasons[2].startswith("env_error: step: ") and "run() gave up" in reasons[2]
    assert group.rewards.tolist()[1:] == [-1.0, -1.0]


def test_a_rubric_raising_keyboard_interrupt_or_system_exit_ends_its_episode_not_the_loop(
    tokenizer, runner, tmp_path
) -> None:
    """Before, a rubric's KeyboardInterrupt or SystemExit left the runner's event loop (every later episode of the
    generator hung): now each ends its own episode as env_error, and the next group on the same runner scores."""
    (tmp_path / "tandem_vf_broken.py").write_text(textwrap.dedent(BROKEN))
    env = EnvConfig(environment="verifiers:tandem-vf-broken", plugin_paths=[str(tmp_path)])
    try:
        factory = environment_factory(env)
        prompt = PromptItem(7, 0, [{"role": "user", "content": "Say something."}], {"vf_idx": 0})
        engine = TextEngine(tokenizer, [["fine"], ["interrupt"], ["exit"]])
        group = run_group(engine, factory, runner, prompt, n=3)
        after = run_group(TextEngine(tokenizer, [["fine"], ["fine"]]), factory, runner, prompt, n=2)
    finally:
        sys.modules.pop("tandem_vf_broken", None)
    reasons = list(group.finish_reasons)
    assert reasons[0] == "done" and group.rewards.tolist() == [1.0, -1.0, -1.0]
    # verifiers scores in a task of its own: its TaskError carries the rubric's exception (as PluginAbort)
    assert reasons[1].startswith("env_error: step: ") and "KeyboardInterrupt: the rubric interrupted" in reasons[1]
    assert reasons[2].startswith("env_error: step: ") and "SystemExit: 3" in reasons[2]
    assert list(after.finish_reasons) == ["done", "done"] and after.rewards.tolist() == [1.0, 1.0]
    assert runner.loop_escapes == 0


def test_prompts_name_their_task_and_a_bad_index_is_refused(tmp_path) -> None:
    """The exporter writes one prompt per task with its `vf_idx`; a prompt naming no task is a clear error."""
    import json

    from actors.environments.verifiers_env import export_prompts, load_verifiers_env
    from common.plugins import search_first

    search_first([str(EXAMPLE)])
    out = tmp_path / "prompts.jsonl"
    assert export_prompts("arith-feedback", {"num_tasks": 3}, str(out)) == 3
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["vf_idx"] for row in rows] == [0, 1, 2]
    assert rows[1]["messages"] == [{"role": "user", "content": TASK_1}]
    loaded = load_verifiers_env("arith-feedback", {"num_tasks": 3})
    with pytest.raises(ValueError, match="vf_idx=7 names no task"):
        loaded.task({"vf_idx": 7})
