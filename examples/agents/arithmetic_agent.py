"""An agent program that trains a model through Tandem's OpenAI-compatible endpoint (actors/environments/openai_server.py).

    tandem run examples/openai_agent.toml &                  # the run: its generator serves 127.0.0.1:8000
    python examples/agents/arithmetic_agent.py               # this agent: runs episodes until the run ends

It knows nothing of Tandem but three HTTP calls: it claims an episode (`POST /tandem/episodes`: an arithmetic
question), asks the model with the stock `openai` client (`chat.completions.create` with the header
`X-Tandem-Episode`), checks the answer itself, and when it is wrong says so and asks once more; then it ends the
episode with its reward (`POST /tandem/episodes/<id>/finish`): 1.0 right at the first answer, 0.5 right at the
second, 0.0 otherwise. Tandem records every turn token-exact and trains on the model's turns.

It runs `--concurrency` episodes at once (the generator samples them in one batch: one at a time would leave the
engine idle) and waits for the endpoint to come up (vLLM takes a minute to load). It stops when the endpoint goes
away after it was up (the run is over), after `--episodes` episodes, or when the endpoint never answers within
`--connect-timeout-s`. An episode the run ends under it (a limit, a timeout, the generator stopping: 404/409) is
counted and skipped. With a token (`auth_token_env` in the config), export the same variable here: `--token-env`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai

EPISODE_HEADER = "X-Tandem-Episode"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
RETRY_S = 1.0  # pause before another claim when the endpoint is not up yet, or has no episode right now
REPLY_TIMEOUT_S = 600.0  # a model turn waits for the engine's batch: minutes on a loaded CPU machine
FEEDBACK = "That is not right. Check the arithmetic and give the final answer after '####'."


class RunOver(Exception):
    """The endpoint stopped answering after it was up: the run has ended."""


def final_answer(reply: str) -> float | None:
    """The number after the last '####' (on its line), else the last number in the reply; None without one."""
    marked = reply.rsplit("####", 1)[1].strip().splitlines()[:1] if "####" in reply else []
    numbers = NUMBER.findall(marked[0]) if marked else []
    numbers = numbers or NUMBER.findall(reply)
    return float(numbers[-1]) if numbers else None


def is_right(reply: str, answer: Any) -> bool:
    found = final_answer(reply)
    return found is not None and abs(found - float(answer)) < 1e-9


class Endpoint:
    """The Tandem endpoint at `base` (http://host:port): the two Tandem calls by hand, the chat through `openai`."""

    def __init__(self, base: str, token: str) -> None:
        self.base = base.rstrip("/")
        self.token = token
        self.chat = openai.OpenAI(
            base_url=f"{self.base}/v1", api_key=token or "unused", max_retries=0, timeout=REPLY_TIMEOUT_S
        )
        self.was_up = False

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(status, JSON answer); RunOver when the endpoint is gone after it was up, ConnectionError before."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.base + path, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=REPLY_TIMEOUT_S) as response:
                self.was_up = True
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            self.was_up = True
            return error.code, json.loads(error.read() or b"{}")
        except (urllib.error.URLError, ConnectionError) as error:
            if self.was_up:
                raise RunOver(str(error)) from None
            raise ConnectionError(f"{self.base} does not answer ({error})") from None

    def claim(self) -> dict[str, Any] | None:
        """An episode to run: {"episode_id", "messages", "metadata", "prompt_id"}; None when none is offered now."""
        status, answer = self.post("/tandem/episodes", {"wait_s": 10})
        if status == 503:
            return None
        if status != 200:
            raise RuntimeError(f"claim refused ({status}): {answer}")
        return answer

    def ask(self, episode_id: str, messages: list[dict[str, str]]) -> str:
        """The model's next turn of the episode (openai.APIStatusError 404/409 when the run ended the episode)."""
        try:
            completion = self.chat.chat.completions.create(
                model="tandem", messages=messages, extra_headers={EPISODE_HEADER: episode_id}
            )
        except openai.APIConnectionError as error:
            raise RunOver(str(error)) from None
        return completion.choices[0].message.content or ""

    def finish(self, episode_id: str, reward: float) -> int:
        return self.post(f"/tandem/episodes/{episode_id}/finish", {"reward": reward})[0]


def run_episode(endpoint: Endpoint, episode: dict[str, Any], attempts: int) -> str:
    """One episode: up to `attempts` answers, feedback after a wrong one. Returns how it ended."""
    messages, answer = list(episode["messages"]), episode["metadata"]["answer"]
    reward = 0.0
    try:
        for attempt in range(attempts):
            reply = endpoint.ask(episode["episode_id"], messages)
            messages.append({"role": "assistant", "content": reply})  # exactly as returned: the history is checked
            if is_right(reply, answer):
                reward = 1.0 - 0.5 * attempt
                break
            if attempt + 1 < attempts:
                messages.append({"role": "user", "content": FEEDBACK})
    except openai.APIStatusError as error:  # the run ended this episode (a limit or timeout): nothing to finish
        return f"ended by the run ({error.status_code})"
    status = endpoint.finish(episode["episode_id"], reward)
    return f"reward {reward}" if status == 200 else f"ended by the run ({status})"


class Budget:
    """Episodes still to start (None: unlimited) and how the finished ones ended; shared by the workers."""

    def __init__(self, episodes: int | None) -> None:
        self.left = episodes
        self.outcomes: Counter[str] = Counter()
        self.lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            if self.left is None:
                return True
            if self.left <= 0:
                return False
            self.left -= 1
            return True

    def give_back(self) -> None:
        with self.lock:
            if self.left is not None:
                self.left += 1

    def record(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1


def work(endpoint: Endpoint, attempts: int, budget: Budget, connect_deadline: float) -> None:
    """One worker: claim and run episodes until the run is over or the budget is spent."""
    while budget.take():
        try:
            episode = endpoint.claim()
        except ConnectionError:  # not up yet: the generator is still starting
            budget.give_back()
            if time.monotonic() > connect_deadline:
                raise
            time.sleep(RETRY_S)
            continue
        except RunOver:
            budget.give_back()
            return
        if episode is None:
            budget.give_back()
            time.sleep(RETRY_S)
            continue
        try:
            budget.record(run_episode(endpoint, episode, attempts))
        except RunOver:
            budget.record("ended by the run (endpoint closed)")
            return


def parser() -> argparse.ArgumentParser:
    """The command line; its defaults fit examples/openai_agent.toml (port, env.max_turns, episodes in flight)."""
    parser = argparse.ArgumentParser(description="Run arithmetic episodes through a Tandem run's OpenAI endpoint.")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the endpoint (env.environment_args host:port)")
    parser.add_argument("--concurrency", type=int, default=32, help="episodes at once (prompts_in_flight x group)")
    parser.add_argument("--episodes", type=int, default=None, help="stop after this many (default: until the run ends)")
    parser.add_argument("--attempts", type=int, default=2, help="answers per episode (<= env.max_turns)")
    parser.add_argument("--connect-timeout-s", type=float, default=600.0, help="how long to wait for the endpoint")
    parser.add_argument("--token-env", default="", help="environment variable holding the bearer token, if any")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run episodes until the run ends (or --episodes); print how they ended. 0, or an exception that says why."""
    command = parser()
    args = command.parse_args(argv)
    token = os.environ.get(args.token_env, "") if args.token_env else ""
    if args.token_env and not token:
        command.error(f"--token-env {args.token_env}: that environment variable is not set")
    endpoint, budget = Endpoint(args.url, token), Budget(args.episodes)
    deadline = time.monotonic() + args.connect_timeout_s
    with ThreadPoolExecutor(args.concurrency) as pool:
        workers = [pool.submit(work, endpoint, args.attempts, budget, deadline) for _ in range(args.concurrency)]
        for worker in workers:
            worker.result()  # a worker's failure (the endpoint never came up, a refused claim) ends the agent
    finished = sum(budget.outcomes.values())
    print(f"{finished} episodes: " + ", ".join(f"{n} {what}" for what, n in sorted(budget.outcomes.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
