"""The tool calculator (examples/envs/tool_calculator.py): Hermes calls of `calculate`, tool messages back, the
reward for the right answer after '####', the per-episode tool-use counts, and its config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.config import load_config
from common.envs import check_step_result, environment_factory
from common.tasks import load_prompts
from common.tool_calls import check_tools, parse_tool_calls, with_tools
from common.types import PromptItem
from examples.envs.tool_calculator import ToolCalculatorEnv, demonstrations, summarize

REPO = Path(__file__).resolve().parents[2]
TASK = PromptItem(
    prompt_id=4, epoch=0, messages=[{"role": "user", "content": "What is 796 * 91 + 210?"}], metadata={"answer": 72646}
)


def call(expression, name: str = "calculate") -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"expression": expression}}) + "\n</tool_call>"


def make_env(**kwargs) -> ToolCalculatorEnv:
    env = ToolCalculatorEnv(**kwargs)
    env.reset(TASK)
    return env


def test_tools_are_a_checked_schema_and_the_chat_opens_with_demonstrations() -> None:
    (tool,) = check_tools(ToolCalculatorEnv.tools)
    assert tool["function"]["name"] == "calculate" and tool["function"]["parameters"]["required"] == ["expression"]
    env = ToolCalculatorEnv(shots=2)
    chat = env.reset(TASK)
    assert chat[0]["role"] == "system" and chat[-1] == TASK.messages[0]
    assert [m["role"] for m in chat[1:-1]] == ["user", "assistant", "tool", "assistant"] * 2
    demo_call = parse_tool_calls(chat[2]["content"])  # each demonstration's call parses and its result is right
    assert demo_call.errors == [] and chat[3]["content"] == chat[4]["content"].removeprefix("#### ")
    assert with_tools(chat, env.tools)[0]["content"].startswith(chat[0]["content"] + "\n\n# Tools")
    assert ToolCalculatorEnv(shots=0).reset(TASK)[1:] == TASK.messages
    assert demonstrations(1) == demonstrations(2)[:4]
    bare = ToolCalculatorEnv(shots=1, question="expression").reset(
        PromptItem(0, 0, [], {"answer": 3, "expression": "1 + 2"})
    )
    assert bare[-1] == {"role": "user", "content": "What is 1 + 2?"} and bare[1]["content"].startswith("What is ")


def test_valid_call_gets_a_tool_message_and_the_right_answer_the_reward() -> None:
    env = make_env()
    first = check_step_result(env.step("Let me compute. " + call("796 * 91 + 210")))
    assert not first.done and first.reward == pytest.approx(0.1)
    (reply,) = first.observation
    assert reply["role"] == "tool" and reply["content"] == "72646"
    final = check_step_result(env.step("The calculator says 72646.\n#### 72646"))
    assert final.done and final.reward == 1.0
    assert final.info["tool_use"] == {
        "valid_calls": 1,
        "failed_calls": 0,
        "malformed_calls": 0,
        "turns": 2,
        "correct": True,
        "tool_use_success": True,
    }


def test_the_bonus_comes_once_and_tool_errors_are_told_to_the_model() -> None:
    env = make_env(max_turns=5)
    first = check_step_result(env.step(call("2 * 3") + call("1/0") + call("3", name="search")))
    assert first.reward == pytest.approx(0.1)
    assert [m["content"] for m in first.observation] == [
        "6",
        "error: calculate failed: CalcError: division by zero",
    ]  # max_calls_per_turn = 2: the third call is not run
    again = check_step_result(env.step(call("__import__('os')") + call(7)))
    assert again.reward == 0.0
    assert again.observation[0]["content"].startswith(
        "error: calculate failed: CalcError: '__import__('os')' is not allowed"
    )
    assert (
        again.observation[1]["content"]
        == "error: bad arguments for calculate: 7 is not of type 'string' (at expression)"
    )
    end = env.step("#### 72646")
    assert end.info["tool_use"]["valid_calls"] == 1 and end.info["tool_use"]["failed_calls"] == 3


def test_malformed_and_unclosed_calls_get_a_user_message_and_no_bonus() -> None:
    env = make_env()
    bad = check_step_result(env.step('<tool_call>{"name": calculate}</tool_call> <tool_call>{"name": "calc'))
    assert bad.reward == 0.0 and [m["role"] for m in bad.observation] == ["user"]
    assert "not valid JSON" in bad.observation[0]["content"] and "never closed" in bad.observation[0]["content"]
    final = env.step("#### 72646")
    assert final.reward == 1.0 and final.info["tool_use"]["malformed_calls"] == 2
    assert final.info["tool_use"]["correct"] and not final.info["tool_use"]["tool_use_success"]


def test_wrong_answer_idle_turns_and_the_turn_limit() -> None:
    env = make_env()
    assert env.step(call("796 * 91 + 210")).reward == pytest.approx(0.1)
    wrong = env.step("#### 72645")
    assert wrong.done and wrong.reward == 0.0 and not wrong.info["tool_use"]["tool_use_success"]
    env = make_env(max_turns=2)
    idle = check_step_result(env.step("Hmm, big numbers."))
    assert not idle.done and idle.reward == 0.0 and "calculate" in idle.observation[0]["content"]
    last = env.step(call("1 + 1"))  # the environment's own limit: no call runs in the last turn
    assert last.done and last.reward == 0.0 and last.info["tool_use"]["valid_calls"] == 0
    answered_with_calls = make_env().step(call("1 + 1") + "\n#### 72646")  # '####' outside the block ends the episode
    assert answered_with_calls.done and answered_with_calls.reward == 1.0


def test_episode_log_and_its_summary(tmp_path) -> None:
    log = tmp_path / "runs" / "tool_use.jsonl"
    ToolCalculatorEnv.prepare(episode_log=str(log))
    for text in ("#### 1", "#### 72646", "#### 72646", "#### 2", "#### 72646"):
        env = make_env(episode_log=str(log))
        if text == "#### 72646":
            env.step(call("796 * 91 + 210"))
        env.step(text)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["tool_use_success"] for r in rows] == [False, True, True, False, True] and rows[0]["prompt_id"] == 4
    summary = summarize(log)  # 20% of 5 episodes: the first one and the last one
    assert summary["first"] == {
        "episodes": 1,
        "valid_calls": 0.0,
        "failed_calls": 0.0,
        "malformed_calls": 0.0,
        "correct": 0.0,
        "tool_use_success": 0.0,
    }
    assert summary["last"]["tool_use_success"] == 1.0 and summary["all"]["correct"] == pytest.approx(3 / 5)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"shots": -1}, "shots"),
        ({"call_bonus": 1.0}, "call_bonus"),
        ({"max_turns": 0}, "max_turns"),
        ({"question": "story"}, "question"),
    ],
)
def test_prepare_refuses_bad_arguments(args, says) -> None:
    with pytest.raises(ValueError, match=says):
        ToolCalculatorEnv.prepare(**args)


def test_config_validates_and_names_the_calculator_problems(monkeypatch, tmp_path) -> None:
    monkeypatch.chdir(REPO)
    config = load_config(REPO / "examples" / "tool_calculator.toml")
    assert config.env.source == load_config(REPO / "examples" / "calculator.toml").env.source
    config.env.environment_args = {**config.env.environment_args, "episode_log": str(tmp_path / "log.jsonl")}
    environment = environment_factory(config.env)()
    records = load_prompts(config.env.source)
    chat = environment.reset(records[0])
    assert chat[-1]["content"] == f"What is {records[0].metadata['expression']}?"
    assert environment.tools == ToolCalculatorEnv.tools
