"""The OpenAI-compatible endpoint (actors/environments/openai_server.py): an agent runs episodes over HTTP, Tandem records them.

The episode driver runs on a scripted engine with SmolLM2's chat template (in a thread, like the generator's loop);
the "agent" is plain urllib against the real HTTP server on a free loopback port. Checked: the agent's episodes
become token-exact samples with the agent's reward; protocol mistakes get 4xx answers saying what to change and
end only their own episode; `tandem generator` serves agents end to end (SIMULATION engine, fake buffer).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from actors.environments.episodes import EpisodeDriver, EpisodeLimits
from actors.environments.openai_server import EPISODE_HEADER, AgentEnvironment, AgentServer
from actors.environments.runner import EnvRunner
from actors.environments.trajectory import build_episode_group
from common.types import PromptItem
from launch.testing import (
    FakeBuffer,
    FakePublisher,
    RoleUnderTest,
    arithmetic_items,
    drive_until_done,
    free_port,
    run_config,
)
from tests.actors.env_fakes import ScriptedEngine

TASK = PromptItem(
    prompt_id=4, epoch=0, messages=[{"role": "user", "content": "What is 6 * 7?"}], metadata={"answer": 42}
)


def post(port: int, path: str, body: dict, episode: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({EPISODE_HEADER: episode} if episode else {})}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def agent(port: int, reward: float, tool_answers: int) -> list[dict]:
    """Claim an episode, ask the model, answer it `tool_answers` times as a tool would, finish with `reward`."""
    status, claimed = post(port, "/tandem/episodes", {"wait_s": 10})
    assert status == 200, claimed
    episode, messages = claimed["episode_id"], list(claimed["messages"])
    for turn in range(tool_answers + 1):
        status, completion = post(port, "/v1/chat/completions", {"model": "x", "messages": messages}, episode)
        assert status == 200, completion
        assert completion["object"] == "chat.completion"
        messages.append(completion["choices"][0]["message"])
        if turn < tool_answers:
            messages.append({"role": "tool", "content": f"result {turn}"})
    status, finished = post(port, f"/tandem/episodes/{episode}/finish", {"reward": reward})
    assert status == 200 and finished["status"] == "finished", finished
    return messages


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def served(tokenizer):
    """(port, engine, start(group_size) -> thread collecting finished groups into a list)."""
    port = free_port()
    engine = ScriptedEngine(tokenizer, seed=3, eos_probability=0.5, max_tokens=6)
    runner = EnvRunner(workers=4)
    limits = EpisodeLimits(
        max_turns=4,
        max_total_tokens=512,
        turn_max_tokens=6,
        max_model_len=4096,
        step_timeout_s=5.0,
        episode_timeout_s=60.0,
        failure_reward=-1.0,
    )
    results: list = []
    AgentServer.shared("127.0.0.1", port)  # up before any episode exists: agents may knock early

    def start(group_size: int) -> threading.Thread:
        driver = EpisodeDriver(engine, lambda: AgentEnvironment("127.0.0.1", port), limits, runner, group_size)
        driver.start_group(9, TASK)
        thread = threading.Thread(target=lambda: results.extend(drive_until_done(driver, timeout_s=60)), daemon=True)
        thread.start()
        return thread

    yield port, engine, start, results
    runner.close()
    AgentServer.shared("127.0.0.1", port).close()


def test_agent_episodes_become_token_exact_samples(served) -> None:
    port, engine, start, results = served
    loop = start(group_size=2)
    conversations = [agent(port, reward=0.75, tool_answers=2), agent(port, reward=0.25, tool_answers=0)]
    loop.join(timeout=30)
    (done,) = results
    group = build_episode_group(done.lease_id, done.prompt, done.results, 0, 0.0)
    group.validate()
    assert group.finish_reasons == ["done", "done"]
    np.testing.assert_allclose(group.rewards, [0.75, 0.25])
    for i, conversation in enumerate(conversations):
        span = slice(int(group.offsets[i]), int(group.offsets[i + 1]))
        sequence = group.prompt_tokens.tolist() + group.completion_tokens[span].tolist()
        requests = sorted(
            (r for rid, r in engine.requests.items() if rid.startswith(f"9:4:{i}:")), key=lambda r: r.request_id
        )
        replies = [m["content"] for m in conversation if m["role"] == "assistant"]
        assert replies == [engine.decode(np.asarray(r.tokens)) for r in requests]
        assert requests[0].prompt == engine.render(TASK)
        for turn, request in enumerate(requests):
            at = len(request.prompt)
            assert sequence[:at] == request.prompt and sequence[at : at + len(request.tokens)] == request.tokens
            if turn + 1 < len(requests):  # the tool's message, rendered as environment tokens
                following = sequence[at + len(request.tokens) : len(requests[turn + 1].prompt)]
                tool = [{"role": "tool", "content": f"result {turn}"}]
                assert following == engine.render_turn(np.asarray(request.tokens), tool)
        assert int(group.loss_mask[span].sum()) == sum(len(r.tokens) for r in requests)


def test_protocol_mistakes_are_refused_with_what_to_change(served) -> None:
    port, _, start, results = served
    assert post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})[0] == 400
    assert post(port, "/v1/chat/completions", {"messages": [], "stream": "yes"}, "abc")[1]["error"][
        "message"
    ].startswith("stream must be true or false")
    status, body = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "nope")
    assert status == 404 and "claim one" in body["error"]["message"]
    loop = start(group_size=2)
    # Episode 1: the agent edits the model's reply in its history -> 409, the episode ends as env_error.
    episode = post(port, "/tandem/episodes", {})[1]["episode_id"]
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    reply = post(port, "/v1/chat/completions", {"messages": messages}, episode)[1]["choices"][0]["message"]
    edited = [
        *messages,
        {"role": "assistant", "content": reply["content"] + " (edited)"},
        {"role": "user", "content": "and?"},
    ]
    status, body = post(port, "/v1/chat/completions", {"messages": edited}, episode)
    assert status == 409 and "differs from the episode's conversation" in body["error"]["message"]
    assert post(port, f"/tandem/episodes/{episode}/finish", {"reward": 1})[0] in (404, 409)
    # Episode 2: a bad finish body is refused (400), a good one accepted.
    other = post(port, "/tandem/episodes", {})[1]["episode_id"]
    post(port, "/v1/chat/completions", {"messages": messages}, other)
    assert post(port, f"/tandem/episodes/{other}/finish", {"reward": "high"})[0] == 400
    assert post(port, f"/tandem/episodes/{other}/finish", {"reward": 2.0})[0] == 200
    loop.join(timeout=30)
    (done,) = results
    reasons = [r.finish_reason for r in done.results]
    assert reasons[0].startswith("env_error: step: AgentError: messages[1] differs") and reasons[1] == "done"
    assert [r.reward for r in done.results] == [-1.0, 2.0]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"hots": "127.0.0.1"}, "unknown key(s) ['hots']; the endpoint takes"),
        ({"port": "8000"}, "env.environment_args.port must be int, got '8000'"),
        ({"port": 70000}, "port must be within 0..65535"),
        ({"allow_remote": "yes"}, "allow_remote must be bool"),
        ({"max_body_bytes": 0}, "max_body_bytes must be >= 1"),
        ({"max_connections": True}, "max_connections must be int"),
        ({"max_abs_reward": float("inf")}, "max_abs_reward must be finite"),
        ({"auth_token_file": "a", "auth_token_env": "B"}, "not both"),
        ({"auth_token_file": "/nonexistent/token"}, "auth_token_file = '/nonexistent/token': cannot read it"),
    ],
)
def test_bad_endpoint_settings_name_the_key(options: dict, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        AgentServer.shared(**{"host": "127.0.0.1", "port": free_port(), **options})
    assert message in str(refused.value)


def test_one_endpoint_per_address_with_one_set_of_settings() -> None:
    port = free_port()
    server = AgentServer.shared("127.0.0.1", port, max_waiting_claims=8)
    try:
        assert AgentServer.shared("127.0.0.1", port, max_waiting_claims=8) is server
        with pytest.raises(ValueError, match="already runs with other settings"):
            AgentServer.shared("127.0.0.1", port)
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{port}.*change env.environment_args"):
            AgentServer(server.settings)  # a second server on a taken port
    finally:
        server.close()
    AgentServer.shared("127.0.0.1", port).close()  # closed: the address is free for other settings


@pytest.mark.integration
def test_tandem_generator_serves_agents_end_to_end(tmp_path) -> None:
    """`tandem generator` (SIMULATION engine) with the endpoint as its environment; agents run every episode."""
    http_port = free_port()
    config = run_config(
        tmp_path / "runs",
        "gen",
        run={"simulate": True},
        algo={"group_size": 2},
        env={
            "environment": "actors.environments.openai_server:AgentEnvironment",
            "environment_args": {"port": http_port},
            "step_timeout_s": 20.0,
        },
        generator={"sim_tokens": 4, "sim_token_s": 0.001, "prompts_in_flight": 1, "reconnect_max_s": 0.5},
    )
    buffer = FakeBuffer(config, arithmetic_items(2), lease_size=1).start()
    publisher = FakePublisher(config.learner.weights_port).start()
    process = RoleUnderTest(config, "generator").start()
    try:
        deadline = time.monotonic() + 30
        finished = 0
        while finished < 4 and time.monotonic() < deadline:
            try:
                agent(http_port, reward=float(finished), tool_answers=1)
                finished += 1
            except (AssertionError, urllib.error.URLError):
                time.sleep(0.2)  # the endpoint is not up yet, or no episode is offered right now
        code, err = process.wait(60), process.output()
    finally:
        process.kill()
        buffer.stop()
        publisher.stop()
    assert code == 0, err[-3000:]
    groups = sorted(buffer.groups.values(), key=lambda g: g.prompt_id)
    assert len(groups) == 2
    assert sorted(float(r) for g in groups for r in g.rewards) == [0.0, 1.0, 2.0, 3.0]
    for group in groups:
        group.validate()
        assert set(group.finish_reasons) <= {"done", "length"} and (group.loss_mask == 0).any()  # sim: length
