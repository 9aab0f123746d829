"""An OpenAI-compatible chat endpoint backed by the generator's engine: existing agent programs run Tandem's episodes.

    [env]                                             # in the run config: the agent is the environment
    environment = "actors.environments.openai_server:AgentEnvironment"
    environment_args = { host = "127.0.0.1", port = 8000 }
    step_timeout_s = 120                              # the agent's longest pause between two model turns

An agent (any OpenAI client) then loops:
    POST /tandem/episodes                         -> {"episode_id", "messages", "metadata", "prompt_id"}: a task to
                                                     run (waits up to 30 s for one; 503 when there is none)
    POST /v1/chat/completions                     header `X-Tandem-Episode: <episode_id>`, body {"messages": [...],
                                                  optionally "tools": [...], "stream": true}
                                                  -> a standard chat.completion whose message is the model's turn
                                                     (with `tool_calls` when it called tools), or its SSE chunks
    ... tool results, more completions: each request repeats the conversation so far (as OpenAI clients do) plus
        the new messages at its end ...
    POST /tandem/episodes/<episode_id>/finish     body {"reward": 1.0} -> the trajectory becomes a sample

How it is recorded. Each episode is a leased prompt's episode, driven by the generator's episode driver
(`actors.environments.episodes`) like any environment: the agent's first request is the first observation (`reset`), each
model turn answers the pending request (`step` gets its text), the messages a later request adds after the model's
reply are the next observation, and `finish` ends the episode (done, its reward). So the trajectory is
token-exact (the model's sampled ids, the new messages rendered as a chat-template delta), groups, leases,
versions, limits and timeouts all work as for other environments. The sampling settings are the generator's
(the trained policy's): a request's temperature, max_tokens, tool_choice etc. are ignored.

Tools, replies and streams (the shapes: `actors.environments.openai_format`). The first request's `tools` (OpenAI format, checked
by `common.tool_calls.check_tools`: 400 with the reason) are the episode's: the driver renders them into the first
observation's system message (the Hermes block of `common.tool_calls.with_tools`), and every later request must
send the same tools (400 otherwise; the episode stays open). The model's `<tool_call>` blocks come back as the
message's `tool_calls` (content: the text outside them, null when empty); the agent sends that message back as its
client serialises it, then `tool` messages (`tool_call_id`, `name`, `content`), which become the next observation.
`finish_reason` is "length" (cut by max_tokens), "tool_calls" or "stop", and `usage` the turn's true counts
(prompt_tokens: the whole episode context the model was given, from the driver's `on_model_turn`). `stream: true`
answers with Server-Sent Events in chat.completion.chunk form (usage in a last chunk with
`stream_options.include_usage`), then `data: [DONE]`: the engine generates a turn as a whole, so the chunks are
sent together when the turn is done, not token by token.

Rules an agent must follow (else its request is refused with 4xx and a message that says what to change):
  * one request at a time per episode; each request's messages start with the episode's conversation so far, the
    model's replies exactly as returned (the history must not be edited: a diverged history ends the episode);
    only the model's replies carry `tool_calls` (another assistant message with them also ends the episode);
  * finish every episode it claimed; an episode the agent leaves longer than `env.step_timeout_s`, or that reaches
    a limit (`env.max_turns`, `env.max_total_tokens`), ends without the agent's reward (its pending request gets
    409, and `finish` then answers 409 too).
  * a `finish` reward is a finite number within `max_abs_reward` (default: the buffer's reward range); another
    is refused with 400 naming the bound, and the episode stays open for a valid `finish`.

Limits and access (all `environment_args`, see `actors.environments.openai_http`): loopback only unless `allow_remote = true`,
which needs a bearer token (`auth_token_file` or `auth_token_env`); bodies up to `max_body_bytes` (413),
`max_connections` open at once, `max_waiting_claims` parked claims and `max_claimed_episodes` claimed episodes
(503 beyond). uvicorn serves it on one event-loop thread, so many agents may wait on their turns at once. The
generator starts it (`AgentEnvironment.prepare`) before its first episode: a bad setting stops the generator there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import threading
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from actors.environments.openai_format import (
    ModelReply,
    TurnCounts,
    agent_messages,
    chunks,
    completion,
    model_reply,
    request_tools,
    stream_request,
    template_messages,
)
from actors.environments.openai_http import (
    AgentApp,
    AgentError,
    EndpointSettings,
    HttpEndpoint,
    Refusal,
    checked_reward,
    checked_wait,
    result_within,
)
from common.envs import StepResult

log = logging.getLogger("tandem.actors.openai_server")

__all__ = ["EPISODE_HEADER", "AgentEnvironment", "AgentError", "AgentServer"]

EPISODE_HEADER = "X-Tandem-Episode"
CLAIM_WAIT_S = 30.0  # a claim waits this long for an episode by default ...
LONGEST_CLAIM_WAIT_S = 300.0  # ... and at most (wait_s)
REPLY_WAIT_S = 3600.0  # an HTTP request waits this long at most for its model turn


@dataclass
class _Event:
    kind: str  # "chat" | "finish"
    messages: list[dict[str, Any]]  # canonical (actors.environments.openai_format)
    reward: float
    reply: concurrent.futures.Future  # resolved with the model's ModelReply (chat) or None (finish); or an exception
    tools: list[dict[str, Any]] | None = None  # the request's tools, checked


class AgentEnvironment:
    """One episode run by an external agent through the HTTP endpoint (see the module docstring). Async methods:
    they wait for the agent on the runner's event loop without holding a thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> None:
        self.server = AgentServer.shared(host, port, **options)
        self.episode_id = secrets.token_hex(8)
        self.task: Any = None
        self.conversation: list[dict[str, Any]] = []  # canonical messages (actors.environments.openai_format)
        self.tools: list[dict[str, Any]] | None = None  # the first request's; the driver renders them (common.envs)
        self._chatted = False  # a chat request was delivered (its tools are the episode's)
        self._counts: TurnCounts | None = None  # the pending model turn's, from the driver (on_model_turn)
        self._event: concurrent.futures.Future = concurrent.futures.Future()
        self._pending: concurrent.futures.Future | None = None  # the agent's request awaiting a model turn
        self.ended = False

    @classmethod
    def process_metrics(cls) -> dict[str, float]:
        """The endpoints' refused requests by kind, summed over this process's endpoints (common.envs: added to the
        generator's metrics): `env/endpoint_refused` and `env/endpoint_refused_<kind>`."""
        refused: Counter[str] = Counter()
        with AgentServer._lock:
            servers = list(AgentServer._shared.values())
        for server in servers:
            refused.update(server.app.refused)
        return {"env/endpoint_refused": float(sum(refused.values()))} | {
            f"env/endpoint_refused_{kind}": float(count) for kind, count in refused.items()
        }

    @classmethod
    def prepare(cls, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> None:
        """At generator start (common.envs.environment_factory): check the settings and start the endpoint, so
        a bad setting or a taken port stops the generator with its reason instead of failing every episode."""
        AgentServer.shared(host, port, **options)

    async def reset(self, task: Any) -> list[dict[str, str]]:
        """The agent's first request: its messages are the first observation (its tools, in `self.tools` since
        `deliver`, join the system message: the driver adds them)."""
        self.task = task
        self.server.offer(self)
        event = await self._next()
        if event.kind != "chat":
            event.reply.set_exception(AgentError("finish before any model turn: send a chat completion first"))
            raise AgentError("the agent finished the episode before the model's first turn")
        try:
            observation = template_messages(event.messages, "messages")
        except ValueError as error:
            event.reply.set_exception(AgentError(str(error)))
            raise AgentError(str(error)) from None
        self.conversation, self._pending = event.messages, event.reply
        return observation

    def on_model_turn(self, prompt_tokens: int, completion_tokens: int, finish_reason: str) -> None:
        """From the episode driver, before `step`: the turn's token counts for its reply's usage and finish_reason."""
        self._counts = TurnCounts(prompt_tokens, completion_tokens, finish_reason)

    async def step(self, model_turn_text: str) -> StepResult:
        turn = sum(1 for message in self.conversation if message["role"] == "assistant")
        reply = model_reply(model_turn_text, self.tools, turn, self._counts)
        self._counts = None
        self._pending.set_result(reply)
        self.conversation = [*self.conversation, reply.record]
        event = await self._next()
        if event.kind == "finish":
            event.reply.set_result(None)
            return StepResult([], reward=event.reward, done=True)
        known = len(self.conversation)
        if event.messages[:known] != self.conversation or len(event.messages) == known:
            problem = next((i for i, (a, b) in enumerate(zip(event.messages, self.conversation)) if a != b), known)
            error = AgentError(
                f"messages[{problem}] differs from the episode's conversation (or nothing new "
                "follows it): repeat the conversation so far, the model's replies unchanged, then "
                "add the new messages"
            )
            event.reply.set_exception(error)
            raise error
        try:
            observation = template_messages(event.messages[known:], f"messages[{known}:]")
        except ValueError as error:
            event.reply.set_exception(AgentError(str(error)))
            raise AgentError(str(error)) from None
        self.conversation, self._pending = event.messages, event.reply
        return StepResult(observation, reward=0.0, done=False)

    def close(self) -> None:
        """The driver ended the episode: refuse the agent's pending and later requests."""
        self.ended = True
        self.server.forget(self)
        for future in (self._pending, self._event):
            if future is not None and not future.done():
                future.set_exception(AgentError("the episode has ended (a limit or timeout of the run)"))
        if self._event.done() and self._event.exception() is None:  # an event nobody will read
            event = self._event.result()
            if not event.reply.done():
                event.reply.set_exception(AgentError("the episode has ended (a limit or timeout of the run)"))

    async def _next(self) -> _Event:
        event = await asyncio.wrap_future(self._event)
        self._event = concurrent.futures.Future()
        return event

    def deliver(self, event: _Event) -> None:
        """From the HTTP thread (one event loop: deliveries never race each other): hand the agent's request to the
        episode, one at a time. The first chat request's tools are the episode's; a later one declaring other tools
        is refused (ValueError: 400) and the episode stays open."""
        if self.ended:
            raise AgentError("the episode has ended (a limit or timeout of the run)")
        if self._event.done():
            raise AgentError("one request at a time per episode: wait for the previous answer")
        if event.kind == "chat" and not self._chatted:
            self.tools, self._chatted = event.tools, True
        elif event.kind == "chat" and event.tools != self.tools:
            declared = f"{len(self.tools)} tool(s)" if self.tools else "no tools"
            raise ValueError(
                f"tools differ from the episode's first request, which declared {declared}: send the same tools "
                "with every request of an episode"
            )
        self._event.set_result(event)


class AgentServer:
    """The endpoint of one (host, port), shared by every `AgentEnvironment` of the process: the episodes offered
    and claimed, and the HTTP server (`actors.environments.openai_http`) that serves them.

    Threads: `offer`/`forget` run on the episode runner's loop, the request handlers on the HTTP thread's loop;
    `lock` guards the episode tables and the parked claims. A parked claim is a future that `offer` resolves
    (marked running first, under the lock) or that the claim itself cancels at its timeout (under the lock), so
    an episode is handed to exactly one claim, or stays offered."""

    _shared: ClassVar[dict[tuple[str, int], AgentServer]] = {}
    _lock = threading.Lock()

    @classmethod
    def shared(cls, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> AgentServer:
        """The process's endpoint on (host, port), started on first use. ValueError on a bad setting (naming
        `env.environment_args.<key>`), or when that endpoint already runs with other settings; OSError when the
        address cannot be bound."""
        settings = EndpointSettings.from_args(host=host, port=port, **options)
        with cls._lock:
            server = cls._shared.get((host, port))
            if server is None:
                server = cls._shared[(host, port)] = cls(settings)
            elif server.settings != settings:
                raise ValueError(
                    f"the agent endpoint on {host}:{port} already runs with other settings ({server.settings}): "
                    "give every episode of the process the same env.environment_args"
                )
            return server

    def __init__(self, settings: EndpointSettings) -> None:
        self.settings = settings
        self.lock = threading.Lock()
        self.episodes: dict[str, AgentEnvironment] = {}  # offered or claimed, not ended
        self.offered: deque[AgentEnvironment] = deque()  # not yet claimed, in offer order
        self.claimed: set[str] = set()  # episode ids claimed and not ended
        self.waiting: deque[concurrent.futures.Future] = deque()  # parked claims, oldest first
        self.app = AgentApp(self, settings)
        self.http = HttpEndpoint(self.app, settings)
        log.info("OpenAI-compatible endpoint on http://%s:%d/v1/chat/completions", settings.host, self.http.port)

    @property
    def port(self) -> int:
        """The port it listens on (the one chosen when settings.port is 0)."""
        return self.http.port

    def offer(self, env: AgentEnvironment) -> None:
        """An episode waits for an agent: handed to the oldest parked claim, else queued for the next claim."""
        with self.lock:
            self.episodes[env.episode_id] = env
            while self.waiting:
                waiter = self.waiting.popleft()
                if waiter.set_running_or_notify_cancel():  # False: that claim gave up
                    self.claimed.add(env.episode_id)
                    waiter.set_result(env)
                    return
            self.offered.append(env)

    def forget(self, env: AgentEnvironment) -> None:
        with self.lock:
            self.episodes.pop(env.episode_id, None)
            self.claimed.discard(env.episode_id)
            if env in self.offered:
                self.offered.remove(env)

    async def claim(self, wait_s: float) -> AgentEnvironment | None:
        """An offered episode, now claimed; None when none is offered within `wait_s`. Refusal (503) when
        `max_claimed_episodes` are claimed and not ended, or `max_waiting_claims` claims are parked already."""
        limits = self.settings
        with self.lock:
            if len(self.claimed) >= limits.max_claimed_episodes:
                raise Refusal(
                    503,
                    "too_many_claimed",
                    f"{len(self.claimed)} episodes are claimed and not finished (max_claimed_episodes): "
                    "finish one, or try again later",
                )
            if self.offered:
                env = self.offered.popleft()
                self.claimed.add(env.episode_id)
                return env
            if len(self.waiting) >= limits.max_waiting_claims:
                raise Refusal(
                    503,
                    "too_many_waiting",
                    f"{len(self.waiting)} claims are waiting for an episode already (max_waiting_claims): try again",
                )
            waiter: concurrent.futures.Future = concurrent.futures.Future()
            self.waiting.append(waiter)
        try:
            await asyncio.wait([asyncio.wrap_future(waiter)], timeout=wait_s)
        except asyncio.CancelledError:  # the request was cancelled (shutdown): an episode handed over is re-offered
            self._withdraw(waiter, reoffer=True)
            raise
        return self._withdraw(waiter, reoffer=False)

    def _withdraw(self, waiter: concurrent.futures.Future, reoffer: bool) -> AgentEnvironment | None:
        """The episode a parked claim was handed, or None after cancelling it (a timeout or close)."""
        with self.lock:
            if waiter.cancel():  # True when not handed an episode (or cancelled by close already)
                if waiter in self.waiting:
                    self.waiting.remove(waiter)
                return None
            env = waiter.result()  # offer marks it running and resolves it under the lock: it is done
            if reoffer and env.episode_id in self.episodes:
                self.claimed.discard(env.episode_id)
                self.offered.appendleft(env)
            return env

    def episode(self, episode_id: str) -> AgentEnvironment:
        with self.lock:
            env = self.episodes.get(episode_id)
        if env is None:
            raise LookupError(f"no running episode {episode_id!r}: claim one with POST /tandem/episodes")
        return env

    async def claim_request(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /tandem/episodes: an episode's task, or Refusal 503 when there is none to run."""
        env = await self.claim(checked_wait(body.get("wait_s", CLAIM_WAIT_S), LONGEST_CLAIM_WAIT_S))
        if env is None:
            raise Refusal(503, "no_episode", "no episode to run right now: try again")
        task = env.task
        return {
            "episode_id": env.episode_id,
            "prompt_id": task.prompt_id,
            "messages": task.messages,
            "metadata": task.metadata,
        }

    async def chat(self, body: dict[str, Any], headers: Mapping[str, str]) -> dict[str, Any] | list[dict[str, Any]]:
        """POST /v1/chat/completions: the model's next turn of the episode named by the EPISODE_HEADER, as a
        chat.completion, or (stream = true) the list of its chat.completion.chunk events."""
        stream, include_usage = stream_request(body)
        episode_id = headers.get(EPISODE_HEADER)
        if not episode_id:
            raise ValueError(
                f"the {EPISODE_HEADER} header is required: claim an episode with "
                "POST /tandem/episodes and send its episode_id"
            )
        # Checked on a worker thread (a tool list's JSON schemas take ~20 ms a tool): the event loop serves the
        # other agents meanwhile. Their errors (TypeError/ValueError: 400) come back here.
        messages, tools = await asyncio.to_thread(_checked_chat, body)
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self.episode(episode_id).deliver(_Event("chat", messages, 0.0, reply, tools))
        answer: ModelReply = await result_within(reply, REPLY_WAIT_S, "model turn")
        return chunks(answer, include_usage) if stream else completion(answer)

    async def finish(self, episode_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST /tandem/episodes/<id>/finish: the episode ends with the agent's reward (checked before anything
        reaches the episode, so a refused reward leaves the episode open)."""
        reward = checked_reward(body.get("reward"), self.settings.max_abs_reward)
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self.episode(episode_id).deliver(_Event("finish", [], reward, reply))
        await result_within(reply, REPLY_WAIT_S, "end of the episode")
        return {"episode_id": episode_id, "status": "finished", "reward": reward}

    def close(self) -> None:
        """Stop serving: parked claims get 503, the HTTP server stops, the (host, port) may be started again."""
        with self.lock:
            for waiter in self.waiting:
                waiter.cancel()
        self.http.stop()
        with AgentServer._lock:
            AgentServer._shared = {k: v for k, v in AgentServer._shared.items() if v is not self}


def _checked_chat(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A chat request's messages and tools, checked (`actors.environments.openai_format`; TypeError/ValueError say what is wrong)."""
    messages = agent_messages(body.get("messages"), "messages")
    if not messages:
        raise ValueError("messages must not be empty")
    return messages, request_tools(body)
