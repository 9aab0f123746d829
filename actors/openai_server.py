"""An OpenAI-compatible chat endpoint backed by the generator's engine: existing agent programs run Tandem's episodes.

    [env]                                             # in the run config: the agent is the environment
    environment = "actors.openai_server:AgentEnvironment"
    environment_args = { host = "127.0.0.1", port = 8000 }
    step_timeout_s = 120                              # the agent's longest pause between two model turns

An agent (any OpenAI client) then loops:
    POST /tandem/episodes                         -> {"episode_id", "messages", "metadata", "prompt_id"}: a task to
                                                     run (waits up to 30 s for one; 503 when there is none)
    POST /v1/chat/completions                     header `X-Tandem-Episode: <episode_id>`, body {"messages": [...]}
                                                  -> a standard chat.completion whose message is the model's turn
    ... tool calls, more completions: each request repeats the conversation so far (as OpenAI clients do) plus
        the new messages at its end ...
    POST /tandem/episodes/<episode_id>/finish     body {"reward": 1.0} -> the trajectory becomes a sample

How it is recorded. Each episode is a leased prompt's episode, driven by the generator's episode driver
(`actors.episodes`) like any environment: the agent's first request is the first observation (`reset`), each
model turn answers the pending request (`step` gets its text), the messages a later request adds after the model's
reply are the next observation, and `finish` ends the episode (done, its reward). So the trajectory is
token-exact (the model's sampled ids, the new messages rendered as a chat-template delta), groups, leases,
versions, limits and timeouts all work as for other environments. The sampling settings are the generator's
(the trained policy's): a request's temperature, max_tokens etc. are ignored, and `stream` is refused.

Rules an agent must follow (else its request is refused with 4xx and a message that says what to change):
  * one request at a time per episode; each request's messages start with the episode's conversation so far, the
    model's replies exactly as returned (the history must not be edited: a diverged history ends the episode);
  * finish every episode it claimed; an episode the agent leaves longer than `env.step_timeout_s`, or that reaches
    a limit (`env.max_turns`, `env.max_total_tokens`), ends without the agent's reward (its pending request gets
    409, and `finish` then answers 409 too).
A model turn's `finish_reason` is reported as "stop" and `usage` as zeros (token counts stay inside Tandem).
Stdlib `http.server` only: one thread per connection, so many agents may wait on their turns at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

from common.envs import StepResult, check_messages

log = logging.getLogger("tandem.actors.openai_server")

EPISODE_HEADER = "X-Tandem-Episode"
CLAIM_WAIT_S = 30.0
REPLY_WAIT_S = 3600.0  # an HTTP request waits this long at most for its model turn
MAX_BODY_BYTES = 16 << 20


class AgentError(RuntimeError):
    """The agent broke the protocol; the message is returned to it and ends the episode (`env_error`)."""


@dataclass
class _Event:
    kind: str  # "chat" | "finish"
    messages: list[dict[str, str]]
    reward: float
    reply: concurrent.futures.Future  # resolved with the model's text (chat) or None (finish); or an exception


class AgentEnvironment:
    """One episode run by an external agent through the HTTP endpoint (see the module docstring). Async methods:
    they wait for the agent on the runner's event loop without holding a thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 8000) -> None:
        self.server = AgentServer.shared(host, port)
        self.episode_id = secrets.token_hex(8)
        self.task: Any = None
        self.conversation: list[dict[str, str]] = []
        self._event: concurrent.futures.Future = concurrent.futures.Future()
        self._pending: concurrent.futures.Future | None = None  # the agent's request awaiting a model turn
        self.ended = False

    async def reset(self, task: Any) -> list[dict[str, str]]:
        self.task = task
        self.server.offer(self)
        event = await self._next()
        if event.kind != "chat":
            event.reply.set_exception(AgentError("finish before any model turn: send a chat completion first"))
            raise AgentError("the agent finished the episode before the model's first turn")
        self.conversation, self._pending = event.messages, event.reply
        return event.messages

    async def step(self, model_turn_text: str) -> StepResult:
        self._pending.set_result(model_turn_text)
        self.conversation = [*self.conversation, {"role": "assistant", "content": model_turn_text}]
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
        self.conversation, self._pending = event.messages, event.reply
        return StepResult(event.messages[known:], reward=0.0, done=False)

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
        """From an HTTP thread: hand the agent's request to the episode (one at a time)."""
        if self.ended:
            raise AgentError("the episode has ended (a limit or timeout of the run)")
        try:
            self._event.set_result(event)
        except concurrent.futures.InvalidStateError:
            raise AgentError("one request at a time per episode: wait for the previous answer") from None


class AgentServer:
    """The HTTP endpoint of one (host, port), shared by every `AgentEnvironment` of the process."""

    _shared: ClassVar[dict[tuple[str, int], AgentServer]] = {}
    _lock = threading.Lock()

    @classmethod
    def shared(cls, host: str, port: int) -> AgentServer:
        with cls._lock:
            if (host, port) not in cls._shared:
                cls._shared[(host, port)] = cls(host, port)
            return cls._shared[(host, port)]

    def __init__(self, host: str, port: int) -> None:
        self.episodes: dict[str, AgentEnvironment] = {}
        self.offered: deque[AgentEnvironment] = deque()
        self.condition = threading.Condition()
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, name="tandem-openai", daemon=True).start()
        log.info("OpenAI-compatible endpoint on http://%s:%d/v1/chat/completions", host, port)

    def offer(self, env: AgentEnvironment) -> None:
        with self.condition:
            self.episodes[env.episode_id] = env
            self.offered.append(env)
            self.condition.notify()

    def forget(self, env: AgentEnvironment) -> None:
        with self.condition:
            self.episodes.pop(env.episode_id, None)
            if env in self.offered:
                self.offered.remove(env)

    def claim(self, wait_s: float) -> AgentEnvironment | None:
        deadline = time.monotonic() + wait_s
        with self.condition:
            while not self.offered:
                if not self.condition.wait(timeout=max(0.0, deadline - time.monotonic())):
                    return None
            return self.offered.popleft()

    def episode(self, episode_id: str) -> AgentEnvironment:
        with self.condition:
            env = self.episodes.get(episode_id)
        if env is None:
            raise LookupError(f"no running episode {episode_id!r}: claim one with POST /tandem/episodes")
        return env

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        with AgentServer._lock:
            AgentServer._shared = {k: v for k, v in AgentServer._shared.items() if v is not self}


def _completion(text: str) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{secrets.token_hex(8)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": "tandem",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


def _handler(server: AgentServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._send(status, {"error": {"message": message, "type": "invalid_request_error"}})

        def _body(self) -> dict[str, Any]:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise ValueError(f"request body over {MAX_BODY_BYTES} bytes")
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
            return body

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "tandem", "object": "model"}]})
            else:
                self._error(404, f"no such endpoint: GET {self.path}")

        def do_POST(self) -> None:
            try:
                body = self._body()
                parts = self.path.strip("/").split("/")
                if parts == ["v1", "chat", "completions"]:
                    self._chat(body)
                elif parts == ["tandem", "episodes"]:
                    self._claim(body)
                elif len(parts) == 4 and parts[:2] == ["tandem", "episodes"] and parts[3] == "finish":
                    self._finish(parts[2], body)
                else:
                    self._error(404, f"no such endpoint: POST {self.path}")
            except (ValueError, TypeError) as error:  # a malformed request: say what is wrong, keep serving
                self._error(400, str(error))
            except LookupError as error:
                self._error(404, str(error).strip("'\""))
            except AgentError as error:
                self._error(409, str(error))

        def _claim(self, body: dict[str, Any]) -> None:
            env = server.claim(float(body.get("wait_s", CLAIM_WAIT_S)))
            if env is None:
                self._error(503, "no episode to run right now: try again")
                return
            task = env.task
            self._send(
                200,
                {
                    "episode_id": env.episode_id,
                    "prompt_id": task.prompt_id,
                    "messages": task.messages,
                    "metadata": task.metadata,
                },
            )

        def _chat(self, body: dict[str, Any]) -> None:
            if body.get("stream"):
                raise ValueError("stream is not supported: send stream=false")
            episode_id = self.headers.get(EPISODE_HEADER)
            if not episode_id:
                raise ValueError(
                    f"the {EPISODE_HEADER} header is required: claim an episode with "
                    "POST /tandem/episodes and send its episode_id"
                )
            messages = check_messages(body.get("messages"), "messages")
            if not messages:
                raise ValueError("messages must not be empty")
            reply: concurrent.futures.Future = concurrent.futures.Future()
            server.episode(episode_id).deliver(_Event("chat", messages, 0.0, reply))
            try:
                text = reply.result(timeout=REPLY_WAIT_S)
            except concurrent.futures.TimeoutError:
                raise AgentError(f"no model turn within {REPLY_WAIT_S:.0f}s") from None
            self._send(200, _completion(text))

        def _finish(self, episode_id: str, body: dict[str, Any]) -> None:
            reward = body.get("reward")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)):
                raise ValueError(f"finish needs a numeric 'reward', got {reward!r}")
            reply: concurrent.futures.Future = concurrent.futures.Future()
            server.episode(episode_id).deliver(_Event("finish", [], float(reward), reply))
            reply.result(timeout=REPLY_WAIT_S)
            self._send(200, {"episode_id": episode_id, "status": "finished", "reward": float(reward)})

    return Handler
