"""Attacks on the OpenAI-compatible endpoint (issue 12, item 7): each is played against the real HTTP server
(uvicorn in this process, on a loopback port) and must fail, with the endpoint still answering afterwards.

Before the fix (stdlib http.server): `Content-Length: -1` read the body to the end, past the 16 MiB limit; a listen
backlog of 5 reset 211 of 400 concurrent claims; `host = "0.0.0.0"` was bound without any opt-in; and a `finish`
reward of 1e39 became inf in float32, so the buffer rejected the whole group, the other agents' samples with it.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
from collections import Counter

import numpy as np
import pytest

from actors.environments import openai_http
from actors.environments.episodes import EpisodeDriver, EpisodeGroup, EpisodeLimits
from actors.environments.openai_server import EPISODE_HEADER, AgentEnvironment, AgentServer
from actors.environments.runner import EnvRunner
from actors.environments.trajectory import build_episode_group
from common.config import EnvConfig
from common.envs import environment_factory
from common.types import PromptItem
from launch.testing import drive_until_done, free_port, wait_until
from tests.actors.env_fakes import ScriptedEngine

TASK = PromptItem(prompt_id=7, epoch=0, messages=[{"role": "user", "content": "What is 6 * 7?"}], metadata={})
CLAIMS = 400  # the burst that the old backlog of 5 answered with 211 resets


def exchange(port: int, raw: bytes) -> tuple[int, bytes]:
    """Send `raw` bytes as they are (a request no well-behaved client would send) and read the one response."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(raw)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.read()


def request(port: int, method: str, path: str, body: dict | None = None, **headers: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = json.dumps(body).encode() if body is not None else None
        connection.request(method, path, body=data, headers={"Content-Type": "application/json", **headers})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def serving(port: int, **headers: str) -> bool:
    return request(port, "GET", "/v1/models", **headers)[0] == 200


def error_message(body: bytes) -> str:
    return json.loads(body)["error"]["message"]


@pytest.fixture
def endpoint():
    """(start(**settings) -> the port of a fresh endpoint); every endpoint started is closed after the test."""
    started: list[AgentServer] = []

    def start(**settings: object) -> int:
        port = free_port()
        started.append(AgentServer.shared("127.0.0.1", port, **settings))
        return port

    yield start
    for server in started:
        server.close()


def offer_episodes(port: int, count: int, **settings: object) -> set[str]:
    """`count` episodes offered for claims without a driver behind them (a claim only reads the task)."""
    ids = set()
    for _ in range(count):
        env = AgentEnvironment("127.0.0.1", port, **settings)
        env.task = TASK
        env.server.offer(env)
        ids.add(env.episode_id)
    return ids


def test_negative_content_length_is_refused(endpoint) -> None:
    port = endpoint()
    head = b"POST /tandem/episodes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: -1\r\n\r\n"
    status, _ = exchange(port, head + b'{"wait_s": 0}' + b" " * 4096)
    assert status == 400  # the HTTP parser refuses the header: nothing of the body is read as a request
    assert serving(port)


@pytest.mark.parametrize(
    ("declared", "expected"),
    [
        (str((16 << 20) + 1), 413),
        (str(2**63), 413),
        ("9" * 40, 400),  # longer than any length the HTTP parser (h11) reads: refused as a malformed header
    ],
)
def test_huge_content_length_is_refused_before_reading(endpoint, declared: str, expected: int) -> None:
    port = endpoint()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n".encode()
    status, body = exchange(port, head)  # no body follows: the refusal must not wait for one
    assert status == expected
    if expected == 413:
        assert f"declares {declared} bytes, over the 16777216 allowed" in error_message(body)
    assert serving(port)


def test_chunked_body_is_cut_at_the_limit_whatever_it_declares(endpoint) -> None:
    """No Content-Length at all (chunked): the streaming read stops at max_body_bytes."""
    port = endpoint(max_body_bytes=1024)
    chunk = b"x" * 1000
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(4)) + b"0\r\n\r\n"
    head = b"POST /tandem/episodes HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    status, body = exchange(port, head + chunks)
    assert status == 413 and "over the 1024 bytes allowed" in error_message(body)
    assert serving(port)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "recursion"),  # nested past what the JSON decoder recurses
        (b'"a string"', "must be a JSON object"),
        (b"{not json", "expecting property name"),
        (b'{"wait_s": NaN}', "wait_s must be a number of seconds within [0, 300]"),
        (b'{"wait_s": 1e308}', "wait_s must be a number of seconds within [0, 300]"),
        (b'{"wait_s": -1}', "wait_s must be a number of seconds within [0, 300]"),
    ],
)
def test_malformed_bodies_are_refused_and_counted(endpoint, body: bytes, message: str) -> None:
    port = endpoint()
    head = f"POST /tandem/episodes HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    status, answer = exchange(port, head + body)
    assert status == 400 and message.lower() in error_message(answer).lower()
    assert AgentServer.shared("127.0.0.1", port).app.refused["bad_request"] == 1
    assert serving(port)


def test_claimed_episodes_are_bounded(endpoint) -> None:
    port = endpoint(max_claimed_episodes=2)
    offer_episodes(port, 3, max_claimed_episodes=2)
    first, second, third = (request(port, "POST", "/tandem/episodes", {"wait_s": 0}) for _ in range(3))
    assert first[0] == second[0] == 200
    assert third[0] == 503 and "claimed and not finished (max_claimed_episodes)" in error_message(third[1])
    server = AgentServer.shared("127.0.0.1", port, max_claimed_episodes=2)
    server.forget(server.episode(json.loads(first[1])["episode_id"]))  # an episode ends: room for one more claim
    assert request(port, "POST", "/tandem/episodes", {"wait_s": 0})[0] == 200


def test_a_body_that_trickles_is_cut_off(endpoint, monkeypatch) -> None:
    """A client that declares a body and never sends it holds its connection only BODY_READ_TIMEOUT_S."""
    monkeypatch.setattr(openai_http, "BODY_READ_TIMEOUT_S", 0.5)
    port = endpoint()
    head = b"POST /tandem/episodes HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    status, body = exchange(port, head + b'{"wait_s":')  # 10 of the 100 bytes, then silence
    assert status == 408 and "did not arrive within 0.5s" in error_message(body)
    assert serving(port)


def test_connections_that_send_no_request_head_are_closed(endpoint, monkeypatch) -> None:
    """Slow-loris: connections that send nothing, or half a head, or half a second head after an answer, would
    each hold one of max_connections forever; each is closed HEAD_TIMEOUT_S after it connected or was answered.
    A request being served (a claim parked longer than that) is not cut."""
    monkeypatch.setattr(openai_http, "HEAD_TIMEOUT_S", 0.5)
    port = endpoint()
    idle, half = (socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(2))
    half.sendall(b"POST /tandem/episodes HTTP/1.1\r\nHost: x\r\n")
    answered = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    answered.request("POST", "/tandem/episodes", body=b'{"wait_s": 2}')  # parked 2 s, 4x the head deadline
    assert answered.getresponse().read() and answered.sock is not None  # answered (503 no_episode), kept alive
    answered.sock.sendall(b"GET /v1/mod")
    for sock in (idle, half, answered.sock):
        assert sock.recv(1024) == b""  # closed by the endpoint (a recv timeout of 30 s would raise)
        sock.close()
    assert serving(port)


def burst_of_claims(port: int, count: int, wait_s: float) -> list[tuple[int, bytes] | BaseException]:
    """`count` claims sent at once (threads released together), each on its own connection."""
    barrier = threading.Barrier(count)
    answers: list[tuple[int, bytes] | BaseException] = [OSError("no answer")] * count

    def claim(i: int) -> None:
        barrier.wait()
        try:
            answers[i] = request(port, "POST", "/tandem/episodes", {"wait_s": wait_s})
        except (OSError, http.client.HTTPException) as error:  # a reset or a dropped connection: what must not happen
            answers[i] = error

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return answers


def test_400_concurrent_claims_each_get_an_answer(endpoint) -> None:
    """The defaults: every claim is answered, 200 with an episode (each offered one exactly once) or 503."""
    port = endpoint()
    offered = offer_episodes(port, 40)
    answers = burst_of_claims(port, CLAIMS, wait_s=1.0)
    failures = [a for a in answers if isinstance(a, BaseException)]
    assert not failures, f"{len(failures)} of {CLAIMS} claims got no HTTP answer: {failures[:3]}"
    statuses = Counter(status for status, _ in answers)
    assert set(statuses) <= {200, 503}, statuses
    claimed = [json.loads(body)["episode_id"] for status, body in answers if status == 200]
    assert sorted(claimed) == sorted(offered)
    reasons = Counter(json.loads(body)["error"]["code"] for status, body in answers if status == 503)
    assert set(reasons) <= {"no_episode", "too_many_waiting"}, reasons  # parked and timed out, or over the limit
    assert serving(port)


def test_parked_claims_are_bounded(endpoint) -> None:
    port = endpoint(max_waiting_claims=2)
    server = AgentServer.shared("127.0.0.1", port, max_waiting_claims=2)
    parked: list[tuple[int, bytes]] = []
    threads = [
        threading.Thread(target=lambda: parked.append(request(port, "POST", "/tandem/episodes", {"wait_s": 60})))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(server.waiting) == 2, 30, "two parked claims")
    status, body = request(port, "POST", "/tandem/episodes", {"wait_s": 60})
    assert status == 503 and "waiting for an episode already (max_waiting_claims)" in error_message(body)
    offered = offer_episodes(port, 2, max_waiting_claims=2)  # the parked claims get them, oldest first
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(status for status, _ in parked) == [200, 200]
    assert {json.loads(body)["episode_id"] for _, body in parked} == offered


def test_connections_beyond_the_limit_get_503_not_resets(endpoint) -> None:
    port = endpoint(max_connections=32)
    answers = burst_of_claims(port, CLAIMS, wait_s=5.0)  # parked claims hold their connections meanwhile
    failures = [a for a in answers if isinstance(a, BaseException)]
    assert not failures, f"{len(failures)} of {CLAIMS} claims got no HTTP answer: {failures[:3]}"
    statuses = Counter(status for status, _ in answers)
    assert set(statuses) == {503}, statuses  # no episode is offered: parked claims time out, the rest are over
    over_limit = sum(body == b"Service Unavailable" for _, body in answers)  # uvicorn's answer beyond the limit
    assert over_limit > 0
    assert serving(port)


def test_remote_bind_is_refused_without_opt_in_or_token(monkeypatch) -> None:
    port = free_port()
    with pytest.raises(ValueError, match=r"host = '0.0.0.0' is not a loopback address.*allow_remote = true"):
        AgentServer.shared("0.0.0.0", port)
    with pytest.raises(ValueError, match="allow_remote = true needs a bearer token: set auth_token_file"):
        AgentServer.shared("0.0.0.0", port, allow_remote=True)
    monkeypatch.delenv("TANDEM_TEST_AGENT_TOKEN", raising=False)
    with pytest.raises(ValueError, match="'TANDEM_TEST_AGENT_TOKEN': that environment variable is not set"):
        AgentServer.shared("0.0.0.0", port, allow_remote=True, auth_token_env="TANDEM_TEST_AGENT_TOKEN")
    # The generator's start-up path refuses it too (before any episode), and nothing was left listening.
    env = EnvConfig(
        environment="actors.environments.openai_server:AgentEnvironment", environment_args={"host": "::", "port": port}
    )
    with pytest.raises(ValueError, match="is not a loopback address"):
        environment_factory(env)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_token_file_that_others_can_read_is_refused(tmp_path) -> None:
    token = tmp_path / "agent.token"
    token.write_text("s3cret-s3cret-s3cret\n")
    os.chmod(token, 0o644)
    with pytest.raises(ValueError, match="others may read it .* chmod 600"):
        AgentServer.shared("0.0.0.0", free_port(), allow_remote=True, auth_token_file=str(token))


def test_remote_endpoint_answers_only_with_its_token(monkeypatch) -> None:
    secret = "a-long-enough-agent-token"
    monkeypatch.setenv("TANDEM_TEST_AGENT_TOKEN", secret)
    port = free_port()
    server = AgentServer.shared("0.0.0.0", port, allow_remote=True, auth_token_env="TANDEM_TEST_AGENT_TOKEN")
    try:
        for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": secret}):
            status, body = request(port, "POST", "/tandem/episodes", {"wait_s": 0}, **headers)
            assert status == 401 and "Authorization: Bearer <token>" in error_message(body)
        assert serving(port, Authorization=f"Bearer {secret}")
        assert server.app.refused["unauthorized"] == 3
    finally:
        server.close()


@pytest.fixture
def drive_group(tiny_model_dir):
    """start(group_size, **endpoint settings) -> (port, thread collecting the finished group): one prompt's
    episodes driven on a scripted engine, the buffer's reward bound at its default (1e6)."""
    from transformers import AutoTokenizer

    engine = ScriptedEngine(AutoTokenizer.from_pretrained(tiny_model_dir), seed=5, eos_probability=0.5, max_tokens=6)
    runner = EnvRunner(workers=4)
    limits = EpisodeLimits(
        max_turns=4,
        max_total_tokens=512,
        turn_max_tokens=6,
        max_model_len=4096,
        step_timeout_s=3.0,  # an abandoned episode ends this long after its refused finish
        episode_timeout_s=60.0,
        failure_reward=-1.0,
    )
    servers: list[AgentServer] = []

    def start(group_size: int, **settings: object) -> tuple[int, threading.Thread, list]:
        port = free_port()
        servers.append(AgentServer.shared("127.0.0.1", port, **settings))
        factory = lambda: AgentEnvironment("127.0.0.1", port, **settings)
        driver = EpisodeDriver(engine, factory, limits, runner, group_size=group_size)
        driver.start_group(11, TASK)
        results: list = []
        thread = threading.Thread(target=lambda: results.extend(drive_until_done(driver, timeout_s=60)), daemon=True)
        thread.start()
        return port, thread, results

    yield start
    runner.close()
    for server in servers:
        server.close()


def start_episode(port: int) -> str:
    status, body = request(port, "POST", "/tandem/episodes", {"wait_s": 10})
    assert status == 200, body
    episode = json.loads(body)["episode_id"]
    status, body = request(
        port, "POST", "/v1/chat/completions", {"messages": TASK.messages}, **{EPISODE_HEADER: episode}
    )
    assert status == 200, body
    return episode


def finish(port: int, episode: str, reward: object) -> tuple[int, bytes]:
    # json.dumps writes NaN as the bare NaN token (as Python clients send it), which json.loads reads back
    return request(port, "POST", f"/tandem/episodes/{episode}/finish", {"reward": reward})


def finished_group(thread: threading.Thread, results: list) -> EpisodeGroup:
    thread.join(timeout=60)
    (done,) = results
    group = build_episode_group(done.lease_id, done.prompt, done.results, 0, 0.0)
    group.validate()
    assert np.isfinite(group.rewards).all() and group.rewards.dtype == np.float32
    return group


def test_overflowing_reward_is_refused_and_the_group_keeps_the_other_samples(drive_group) -> None:
    port, thread, results = drive_group(3)
    retried, abandoned, fine = (start_episode(port) for _ in range(3))
    for reward in (1e39, float("nan"), float("inf"), -(10**400)):
        status, body = finish(port, retried, reward)
        assert status == 400 and "outside [-1e+06, 1e+06]" in error_message(body), body
    assert finish(port, abandoned, 1e39)[0] == 400  # ... and this agent never sends a valid reward
    assert finish(port, retried, 0.5)[0] == 200  # the refusal left the episode open
    assert finish(port, fine, 1.0)[0] == 200
    group = finished_group(thread, results)
    by_reward = sorted(zip(group.rewards.tolist(), group.finish_reasons, strict=True))
    assert by_reward == [(-1.0, "env_timeout"), (0.5, "done"), (1.0, "done")]
    assert serving(port)


def test_reward_past_the_buffer_bound_fails_only_its_own_episode(drive_group) -> None:
    """An endpoint set above the buffer's bound admits 1e38 (finite in float32); the episode driver, which holds
    buffer.max_abs_reward, ends that episode as env_error, and the group's other sample is delivered."""
    port, thread, results = drive_group(2, max_abs_reward=3e38)
    overflowing, fine = start_episode(port), start_episode(port)
    assert finish(port, overflowing, 1e38)[0] == 200
    assert finish(port, fine, 0.25)[0] == 200
    group = finished_group(thread, results)
    by_reward = sorted(zip(group.rewards.tolist(), group.finish_reasons, strict=True))
    assert by_reward[1] == (0.25, "done")
    assert by_reward[0][0] == -1.0 and by_reward[0][1].startswith("env_error: reward terminal 1e+38 outside [-1e+06")
