"""Scoring (actors/rewards/functions.py): the reward function, an HTTP endpoint, and the faults both survive."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from actors.rewards.functions import RewardScorer
from common.config import EnvConfig


def test_function_rewards_are_summed_components():
    scorer = RewardScorer(EnvConfig(reward_fn="common.tasks:arithmetic_reward"))
    score = scorer.score("the answer is 4", {"answer": 4})
    assert (
        score.error is None
        and score.components["correct"] == 1.0
        and score.reward == pytest.approx(sum(score.components.values()))
    )


def test_a_raising_function_gets_the_fallback_and_is_counted():
    scorer = RewardScorer(EnvConfig(reward_fn="tests.actors.reward_fns:explode_or_length", failure_reward=-0.5))
    good = scorer.score("abc", {})
    bad = scorer.score("abc", {"explode": True})
    assert good.error is None and good.reward == pytest.approx(1.03)
    assert bad.reward == -0.5 and bad.components == {} and bad.error.startswith("RuntimeError: reward exploded")
    assert scorer.errors == 1


RELEASE = threading.Event()  # what a blocking reward function waits for (set at the test's end: no thread lingers)


def blocking_reward(completion: str, metadata: dict) -> float:
    """Blocks (until RELEASE) on a completion that says so; 1.0 otherwise."""
    if completion == "block":
        RELEASE.wait(60)
    return 1.0


def test_a_blocking_function_is_cut_at_the_timeout_and_the_next_call_runs():
    """A reward function that blocks ends its own sample (failure_reward, TimeoutError) within env.reward_timeout_s,
    never the generator's loop; the next call gets a fresh worker; past MAX_ABANDONED blocked calls still running,
    calls are refused at once with the reason."""
    from actors.rewards import functions as rewards

    RELEASE.clear()
    scorer = RewardScorer(EnvConfig(reward_fn=f"{__name__}:blocking_reward", reward_timeout_s=0.2, failure_reward=-1.0))
    try:
        started = time.monotonic()
        blocked = scorer.score("block", {})
        took = time.monotonic() - started
        assert blocked.reward == -1.0 and blocked.error.startswith(
            "TimeoutError: the function ran past env.reward_timeout_s"
        )
        assert took < 0.2 + 1.0  # the timeout, plus scheduling slack on a loaded 2-core machine
        assert scorer.score("fine", {}).reward == 1.0  # a fresh worker: not queued behind the blocked call
        for _ in range(rewards.MAX_ABANDONED - 1):
            scorer.score("block", {})
        started = time.monotonic()
        refused = scorer.score("fine", {})
        assert refused.reward == -1.0 and "still running" in refused.error and time.monotonic() - started < 0.2
        assert scorer.timeouts == rewards.MAX_ABANDONED and scorer.errors == rewards.MAX_ABANDONED + 1
    finally:
        RELEASE.set()
        scorer.close()


def test_a_misnamed_function_fails_at_start_with_the_spec_in_the_message():
    with pytest.raises((ImportError, AttributeError), match="nope"):
        RewardScorer(EnvConfig(reward_fn="common.tasks:nope"))


class _Endpoint(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["metadata"].get("fail"):
            self.send_response(500)
            self.end_headers()
            return
        answer = {"reward": len(body["completion"]), "components": {"len": len(body["completion"])}}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def endpoint():
    server = HTTPServer(("127.0.0.1", 0), _Endpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/reward"
    finally:
        server.shutdown()
        server.server_close()


def test_http_endpoint_scores_and_its_failures_fall_back(endpoint):
    scorer = RewardScorer(EnvConfig(reward_url=endpoint, reward_timeout_s=5.0, failure_reward=0.25))
    score = scorer.score("hello", {"answer": 1})
    assert score.reward == 5.0 and score.components == {"len": 5.0} and score.error is None
    failed = scorer.score("hello", {"fail": True})
    assert failed.reward == 0.25 and "HTTPError" in failed.error and scorer.errors == 1
