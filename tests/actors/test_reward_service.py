"""The reward service (actors/rewards/service.py) and its client (actors/rewards/client.py): whole groups scored in
shared batches, bad messages refused while the service stays up, and a dead or slow service survived and counted."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
import zmq

from actors.rewards.client import RewardClient
from actors.rewards.model import RewardModelScorer
from actors.rewards.service import RewardService, open_reward_server
from common.sockets import Client, Request, Server, SocketSecurity, free_port
from common.types import ErrorReply, Heartbeat, RewardReply, RewardRequest
from common.wire import decode, encode
from tests.actors.reward_models import make_tiny_reward_model
from tests.actors.test_reward_model import BATCH_TOLERANCE

PROMPT = [{"role": "user", "content": "What is 2 + 5?"}]
GROUPS = [["2 + 5 = 7\n#### 7", "#### 8"], ["seven", "7", "it is 7, surely: 2 + 5 = 7"], ["no idea"]]


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_reward_model(tiny_model_dir, tmp_path_factory.mktemp("rm") / "tiny-rm", seed=2)


@pytest.fixture
def service(rm_dir: Path):
    server = open_reward_server("127.0.0.1", free_port(), SocketSecurity())
    scorer = RewardModelScorer(rm_dir, "float32", batch_size=4, max_len=512, normalize=False)
    yield RewardService(scorer, server)
    server.close()


def _address(service: RewardService) -> str:
    return service.server.socket.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://")


def _serve_until(service: RewardService, client: RewardClient, groups: int, timeout_s: float = 30.0) -> list:
    """Alternate the service's batches and the client's collection until `groups` results came back."""
    results, deadline = [], time.monotonic() + timeout_s
    while len(results) < groups and time.monotonic() < deadline:
        service.serve_batch(0.02)
        results += client.collect(time.monotonic(), wait_s=0.02)
    return results


def test_the_services_batched_scores_equal_one_by_one_scores(service: RewardService, rm_dir: Path):
    client = RewardClient(_address(service), SocketSecurity(), timeout_s=60.0, name="generator-0")
    for key, completions in enumerate(GROUPS):
        client.submit(key, PROMPT, completions, time.monotonic())
    results = {r.key: r for r in _serve_until(service, client, len(GROUPS))}
    alone = RewardModelScorer(rm_dir, "float32", batch_size=1, max_len=512, normalize=False)
    for key, completions in enumerate(GROUPS):
        one_by_one = [alone.score_group(PROMPT, [text])[0] for text in completions]
        assert results[key].scores == pytest.approx(one_by_one, abs=BATCH_TOLERANCE, rel=0)  # see BATCH_TOLERANCE
    counters = service.counters
    assert counters.groups == 3 and counters.samples == 6 and counters.score_errors == 0 and counters.scoring_s > 0
    assert client.fallbacks == 0 and client.scored == 3
    client.close()


class _QueuedServer:
    """A server whose requests are already queued (what several generators leave between two batches)."""

    def __init__(self, requests: list[Request]) -> None:
        self.queue, self.replies, self.rejected = list(requests), [], {}

    def poll(self, timeout_ms: int) -> Request | None:
        return self.queue.pop(0) if self.queue else None

    def reply(self, request: Request, message: RewardReply) -> None:
        self.replies.append(message)


class _CountingScorer:
    batch_size = 5

    def __init__(self) -> None:
        self.calls: list[int] = []

    def score_chats(self, chats: list) -> list[float]:
        self.calls.append(len(chats))
        return [float(len(chat[-1]["content"])) for chat in chats]


def _request(request_id: int, completions: list[str]) -> Request:
    message = RewardRequest(request_id=request_id, prompt=PROMPT, completions=completions)
    return Request(b"peer", b"\0" * 8, message, [], role="generator")


def test_queued_groups_share_one_scoring_call_up_to_the_batch_size():
    server = _QueuedServer([_request(i, ["a" * i, "b"]) for i in range(1, 5)])  # 4 groups of 2 completions
    scorer = _CountingScorer()
    service = RewardService(scorer, server)
    assert service.serve_batch(0.0) == 2  # 2 + 2 + 1 of the third group: 5 completions, two groups complete
    assert service.serve_batch(0.0) == 2  # the fourth group (not reached before), then the rest of the third
    assert scorer.calls == [5, 3]
    replies = sorted((r.request_id, r.scores) for r in server.replies)
    assert replies == [(i, [float(i), 1.0]) for i in range(1, 5)]


def test_a_small_request_is_not_starved_behind_a_huge_batch() -> None:
    """Issue 37, item 6 (before: one huge batch made another request wait 91.5 s). A group of 4,000 completions
    arrives first, a group of 2 right after: the small one is answered after at most two batches (10 completions
    scored), the huge one after all of its own, each with its own scores."""
    huge = RewardRequest(1, PROMPT, [str(i) for i in range(4000)])
    small = RewardRequest(2, PROMPT, ["ab", "abc"])
    server = _QueuedServer(
        [Request(b"a", b"\0" * 8, huge, [], "generator"), Request(b"b", b"\0" * 8, small, [], "generator")]
    )
    scorer = _CountingScorer()
    service = RewardService(scorer, server)
    started = time.monotonic()
    while not server.replies:
        service.serve_batch(0.0)
    assert [r.request_id for r in server.replies] == [2] and server.replies[0].scores == [2.0, 3.0]
    assert sum(scorer.calls) <= 2 * scorer.batch_size
    while len(server.replies) < 2:
        service.serve_batch(0.0)
    assert server.replies[1].scores == [float(len(str(i))) for i in range(4000)]
    assert time.monotonic() - started < 10


def test_malformed_and_refused_messages_are_counted_and_the_service_stays_up(service: RewardService):
    address = _address(service)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.METADATA, b"X-Tandem-Role:generator")  # a generator's socket, sending garbage
    raw.connect(f"tcp://{address}")
    raw.send_multipart([b"", b"\1" * 8, b"\xc1 not msgpack"])  # garbage
    raw.send_multipart([b"", b"\2" * 8, msgpack.packb({"p": 999, "t": "reward_request", "a": 0, "f": {}})])
    bad = encode(RewardRequest(request_id=1, prompt=PROMPT, completions=["x"]))
    header = msgpack.unpackb(bad[0])
    header["f"]["completions"] = []  # a group of no completions breaks the contract
    raw.send_multipart([b"", b"\3" * 8, msgpack.packb(header)])
    learner = Client(address, SocketSecurity(), "learner", role="learner")
    stranger = Client(address, SocketSecurity(), "someone", role="generator")
    for _ in range(5):
        service.serve_batch(0.05)
    for _ in range(3):  # each sender is told why, under its own request id
        assert raw.poll(5000)
        assert isinstance(decode(raw.recv_multipart()[2:])[0], ErrorReply)
    not_asking = [
        (learner, RewardRequest(request_id=1, prompt=PROMPT, completions=["x"])),  # a role that may not ask
        (stranger, Heartbeat(generator_id=0, policy_version=0, lease_ids=[])),  # not a reward request
    ]
    for client, message in not_asking:
        client.send(message)
        service.serve_batch(2.0)
        assert isinstance(client.receive(5.0)[1], ErrorReply)
        client.close()
    rejected = dict(service.server.rejected)
    assert rejected == {"garbage": 1, "wrong_version": 1, "invalid_fields": 1, "forbidden_role": 1, "refused": 1}
    client = RewardClient(address, SocketSecurity(), timeout_s=60.0, name="generator-0")
    client.submit("after", PROMPT, ["7"], time.monotonic())
    [result] = _serve_until(service, client, 1)
    assert result.key == "after" and result.scores is not None and len(result.scores) == 1
    assert service.counters.values()["reward_service/rejected"] == 5
    raw.close()
    client.close()


def test_a_slow_service_gives_the_fallback_and_its_late_reply_is_dropped_and_counted():
    server = Server("127.0.0.1", free_port(), SocketSecurity(), name="slow-reward")
    address = server.socket.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://")
    client = RewardClient(address, SocketSecurity(), timeout_s=5.0, name="generator-0")
    sent_at = time.monotonic()
    client.submit("slow", PROMPT, ["7", "8"], sent_at)
    request = None
    while request is None and time.monotonic() < sent_at + 30:  # sent once the connection is up
        client.collect(time.monotonic())
        request = server.poll(timeout_ms=50)
    assert isinstance(request.message, RewardRequest) and request.role == "generator"
    [result] = client.collect(sent_at + 5.0)  # its deadline: the service has not answered
    assert result.key == "slow" and result.scores is None and "no reply within" in result.error
    server.reply(request, RewardReply(request_id=request.message.request_id, scores=[0.1, 0.2]))
    deadline = time.monotonic() + 10
    while client.late_replies == 0 and time.monotonic() < deadline:
        assert client.collect(time.monotonic()) == []  # nothing is waiting: the reply is no result
        time.sleep(0.02)
    assert client.late_replies == 1 and client.fallbacks == 1
    client.close()
    server.close()


FALLBACK = -7.0  # far from any score of the tiny RM (|s| < 1): a fallback is told apart from a score


@pytest.mark.integration  # starts `tandem reward` (twice) and a simulated `tandem generator`
def test_a_killed_reward_service_is_survived_counted_and_used_again_once_restarted(rm_dir: Path, tmp_path: Path):
    import numpy as np

    from common.metrics import read_metrics
    from launch.testing import FakeBuffer, FakePublisher, RoleUnderTest, arithmetic_items, run_config

    config = run_config(
        tmp_path / "runs",
        "killed-rm",
        run={"simulate": True},
        algo={"group_size": 2},
        env={"reward_model": str(rm_dir), "reward_fn_weight": 0.0, "failure_reward": FALLBACK},
        reward={"port": free_port(), "timeout_s": 5.0},
        generator={"sim_tokens": 4, "sim_token_s": 0.001, "prompts_in_flight": 2, "reconnect_max_s": 0.5},
    )
    reward = RoleUnderTest(config, "reward")
    generator = RoleUnderTest(config, "generator")

    def bound(times: int) -> bool:
        return reward.output().count("reward service on") >= times

    def new_groups(buffer: FakeBuffer, first_id: int, count: int) -> list:
        buffer.add_prompts(arithmetic_items(count, first_id=first_id))
        groups = buffer.wait_for_groups(first_id + count, timeout_s=60)
        return sorted((g for g in groups if g.prompt_id >= first_id), key=lambda g: g.prompt_id)

    buffer = FakeBuffer(config, [], lease_size=2, when_empty="full")
    with buffer, FakePublisher(config.learner.weights_port), reward, generator:
        reward.wait_until(lambda: bound(1), 120, "the reward service to bind")
        for group in new_groups(buffer, 0, 4):  # the service is up: scores, the verifier recorded beside them
            scores = group.reward_components["reward_model"]
            assert np.all(np.abs(scores) < 1) and np.array_equal(group.rewards, scores)  # reward_fn_weight 0
            assert "correct" in group.reward_components and not any("error" in r for r in group.finish_reasons)
        reward.kill()  # SIGKILL: no goodbye
        for group in new_groups(buffer, 4, 2):  # the generator goes on: the fallback, marked on every sample
            assert np.all(group.reward_components["reward_model"] == FALLBACK)
            assert all(r.startswith("env_error: reward: reward_model: ") for r in group.finish_reasons)
        reward.start()
        reward.wait_until(lambda: bound(2), 120, "the restarted reward service to bind")
        for group in new_groups(buffer, 6, 2):  # ZeroMQ reconnected by itself: scores again
            assert np.all(np.abs(group.reward_components["reward_model"]) < 1)
        assert generator.stop() == 0
        assert reward.stop() == 0  # SIGTERM: it finishes the batch in hand and exits cleanly
    assert "reward service stopped: " in reward.output()
    records = read_metrics(config.run.run_dir / "generator-0.jsonl")
    assert records[-1]["actor/reward_model_fallbacks"] == 2  # the two groups scored while the service was dead
    assert "reward_model falls back" in generator.output()
