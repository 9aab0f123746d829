"""Tool calls, streaming and usage through the OpenAI-compatible endpoint, driven by the stock `openai` client.

The episode driver runs on a policy engine with SmolLM2's chat template (tests/actors/env_fakes.PolicyEngine): it
writes a Hermes `<tool_call>` when the prompt lists tools and no tool has answered yet, the final answer after a
tool's answer, and rambles past its max_tokens when asked to. The agent is `openai.OpenAI` against the real HTTP
server. Checked: tools -> tool_calls -> tool result -> final answer with streaming off and on, each reply's usage
against the tokens the trajectory recorded, the trajectory token-exact; bad or changed tools refused with 400.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import urllib.request

import numpy as np
import openai
import pytest

from actors.engine.api import FinishedSample
from actors.environments.episodes import EpisodeDriver, EpisodeLimits
from actors.environments.openai_server import EPISODE_HEADER, AgentEnvironment, AgentServer
from actors.environments.runner import EnvRunner
from actors.environments.trajectory import build_episode_group
from common.tool_calls import with_tools
from common.types import PromptItem
from launch.testing import drive_until_done, free_port
from tests.actors.env_fakes import PolicyEngine
from tests.actors.test_openai_server import post

TASK = PromptItem(prompt_id=5, epoch=0, messages=[{"role": "user", "content": "What is 6 * 7?"}], metadata={})
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
CALL_TEXT = 'Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
ANSWER = "The answer is 42."
TURN_MAX_TOKENS = 40  # the tool call and the answer fit; the ramble (200 words) does not


def policy(prompt: str) -> str:
    """The model: call the calculator when tools are listed (unless a tool just answered), else answer; ramble
    when the last message asks it to."""
    last = prompt.rsplit("<|im_start|>", 2)[-2]  # the last message, before the generation prompt
    if "ramble" in last:
        return " ".join(["word"] * 200)
    if "<tools>" in prompt and not last.startswith("tool"):
        return CALL_TEXT
    return ANSWER


class TruthfulPolicyEngine(PolicyEngine):
    """PolicyEngine whose cut turns (no end-of-turn token: max_tokens reached) finish with "length"."""

    def step(self) -> list[FinishedSample]:
        end = self.turns.end_of_turn_id()
        return [
            dataclasses.replace(s, finish_reason="stop" if s.completion_tokens[-1] == end else "length")
            for s in super().step()
        ]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def served(tokenizer):
    """(port, engine, client, start(group_size) -> the driver's thread, results: finished groups)."""
    port = free_port()
    engine = TruthfulPolicyEngine(tokenizer, policy)
    runner = EnvRunner(workers=4)
    limits = EpisodeLimits(4, 2048, TURN_MAX_TOKENS, 4096, 10.0, 60.0, failure_reward=-1.0)
    results: list = []
    AgentServer.shared("127.0.0.1", port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)

    def start(group_size: int) -> threading.Thread:
        driver = EpisodeDriver(engine, lambda: AgentEnvironment("127.0.0.1", port), limits, runner, group_size)
        driver.start_group(7, TASK)
        thread = threading.Thread(target=lambda: results.extend(drive_until_done(driver, timeout_s=60)), daemon=True)
        thread.start()
        return thread

    yield port, engine, client, start, results
    runner.close()
    AgentServer.shared("127.0.0.1", port).close()


def claim(port: int) -> tuple[str, list, dict]:
    status, claimed = post(port, "/tandem/episodes", {"wait_s": 10})
    assert status == 200, claimed
    return claimed["episode_id"], list(claimed["messages"]), {EPISODE_HEADER: claimed["episode_id"]}


def counts(usage: openai.types.CompletionUsage) -> dict[str, int]:
    return {key: getattr(usage, key) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}


def streamed(client: openai.OpenAI, **request) -> tuple[dict, str, dict | None]:
    """(the assistant message accumulated from the chunks, finish_reason, usage) of a streamed completion."""
    content, calls, finish, usage = "", {}, None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **request):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            assert chunk.choices == []  # the usage chunk is the last one, with no choices
            usage = counts(chunk.usage)
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "type": "function", "function": {"name": ""}})
                call["id"] += delta.id or ""
                call["function"]["name"] += delta.function.name or ""
                call["function"]["arguments"] = call["function"].get("arguments", "") + delta.function.arguments
            finish = choice.finish_reason or finish
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish, usage


def tool_episode(port: int, client: openai.OpenAI, stream: bool) -> list[dict]:
    """One episode: the model calls the calculator, the agent answers as the tool, the model gives the answer.
    Returns each reply's (finish_reason, usage) and the messages, for the checks against the trajectory."""
    episode, messages, headers = claim(port)
    turns = []
    for turn in range(2):
        request = {"model": "tandem", "messages": messages, "tools": TOOLS, "extra_headers": headers}
        if stream:
            message, finish, usage = streamed(client, **request)
        else:
            reply = client.chat.completions.create(**request)
            choice, usage = reply.choices[0], counts(reply.usage)
            message, finish = choice.message, choice.finish_reason  # sent back as the client serialises it
        turns.append((finish, usage))
        messages.append(message)
        if turn == 0:
            call = message["tool_calls"][0] if stream else message.tool_calls[0].model_dump()
            assert call["function"]["name"] == "calculate" and finish == "tool_calls"
            assert json.loads(call["function"]["arguments"]) == {"expression": "6 * 7"}
            assert (message["content"] if stream else message.content) == "Let me compute."
            messages.append({"role": "tool", "tool_call_id": call["id"], "name": "calculate", "content": "42"})
        else:
            assert (message["content"] if stream else message.content) == ANSWER and finish == "stop"
            assert (message.get("tool_calls") if stream else message.tool_calls) is None
    assert post(port, f"/tandem/episodes/{episode}/finish", {"reward": 1.0})[0] == 200
    return turns


def test_tools_tool_calls_tool_result_answer_with_true_usage(served) -> None:
    port, engine, client, start, results = served
    loop = start(group_size=2)
    replies = [tool_episode(port, client, stream=False), tool_episode(port, client, stream=True)]
    loop.join(timeout=30)
    (done,) = results
    group = build_episode_group(done.lease_id, done.prompt, done.results, 0, 0.0)
    group.validate()
    assert group.finish_reasons == ["done", "done"]
    first_prompt = engine.render(dataclasses.replace(TASK, messages=with_tools(TASK.messages, TOOLS)))
    for i, turns in enumerate(replies):
        requests = sorted(
            (r for k, r in engine.requests.items() if k.startswith(f"7:5:{i}:")), key=lambda r: r.request_id
        )
        assert len(requests) == 2 and requests[0].prompt == first_prompt  # the tools block joined the system message
        for (finish, usage), request in zip(turns, requests, strict=True):
            assert usage == {
                "prompt_tokens": len(request.prompt),
                "completion_tokens": len(request.tokens),
                "total_tokens": len(request.prompt) + len(request.tokens),
            }
        span = slice(int(group.offsets[i]), int(group.offsets[i + 1]))
        sequence = group.prompt_tokens.tolist() + group.completion_tokens[span].tolist()
        at = len(requests[0].prompt)
        assert sequence[at : at + len(requests[0].tokens)] == requests[0].tokens  # the model's ids, as sampled
        tool = [{"role": "tool", "tool_call_id": "x", "name": "calculate", "content": "42"}]
        rendered = engine.render_turn(np.asarray(requests[0].tokens), tool)
        assert sequence[at + len(requests[0].tokens) : len(requests[1].prompt)] == rendered
        assert sequence[len(requests[1].prompt) :] == requests[1].tokens
        assert int(group.loss_mask[span].sum()) == sum(len(r.tokens) for r in requests)


def test_a_cut_turn_is_length_and_plain_chat_streams_without_usage(served) -> None:
    port, _, client, start, results = served
    loop = start(group_size=1)
    episode, messages, headers = claim(port)
    messages = [{"role": "user", "content": "Please ramble."}]
    reply = client.chat.completions.create(model="tandem", messages=messages, extra_headers=headers)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == TURN_MAX_TOKENS
    messages += [reply.choices[0].message.model_dump(), {"role": "user", "content": "Now answer."}]
    body = json.dumps({"model": "tandem", "messages": messages, "stream": True}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        body,
        {"Content-Type": "application/json", EPISODE_HEADER: episode},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in response.read().decode().split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": ANSWER}, {}]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert all("usage" not in c for c in chunks) and len({c["id"] for c in chunks}) == 1
    assert post(port, f"/tandem/episodes/{episode}/finish", {"reward": 0.5})[0] == 200
    loop.join(timeout=30)
    (done,) = results
    assert [r.finish_reason for r in done.results] == ["done"] and done.results[0].turns == 2


def test_bad_or_changed_tools_are_refused_and_the_episode_stays_open(served) -> None:
    port, _, client, start, results = served
    loop = start(group_size=1)
    episode, messages, headers = claim(port)
    bad = [{"type": "function", "function": {"name": "two words", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.name must match"):
        client.chat.completions.create(model="tandem", messages=messages, tools=bad, extra_headers=headers)
    with pytest.raises(openai.BadRequestError, match="stream_options is only allowed with stream"):
        client.chat.completions.create(
            model="tandem", messages=messages, stream_options={"include_usage": True}, extra_headers=headers
        )
    first = client.chat.completions.create(model="tandem", messages=messages, tools=TOOLS, extra_headers=headers)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    changed = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "description": "Another description."}}]
    for tools in (changed, openai.NOT_GIVEN):
        with pytest.raises(openai.BadRequestError, match="tools differ from the episode's first request"):
            client.chat.completions.create(model="tandem", messages=messages, tools=tools, extra_headers=headers)
    final = client.chat.completions.create(model="tandem", messages=messages, tools=TOOLS, extra_headers=headers)
    assert final.choices[0].message.content == ANSWER
    assert post(port, f"/tandem/episodes/{episode}/finish", {"reward": 1.0})[0] == 200
    loop.join(timeout=30)
    (done,) = results
    assert [r.finish_reason for r in done.results] == ["done"] and done.results[0].reward == 1.0


def test_tool_messages_keep_their_call_id_and_name_for_the_chat_template() -> None:
    from common.envs import check_messages

    sent = [{"role": "tool", "tool_call_id": "call_0_0_ab", "name": "calculate", "content": "42"}]
    assert check_messages(sent, "step() observation") == sent
    assert check_messages([{"role": "user", "content": "hi", "name": 3}], "x") == [{"role": "user", "content": "hi"}]
