"""The HTTP layer of the OpenAI-compatible endpoint (actors/environments/openai_server.py): settings, limits, auth, the ASGI app.

    settings = EndpointSettings.from_args(host="127.0.0.1", port=8000)     # env.environment_args, checked
    http = HttpEndpoint(AgentApp(server, settings), settings)               # bound and serving when this returns
    http.stop()

uvicorn (h11, asyncio) serves a small ASGI app on one event-loop thread: a waiting agent costs a coroutine, not a
thread. What an agent may cost the generator is bounded here:
  * bodies: at most `max_body_bytes`, read as a stream that stops at the limit whatever Content-Length says
    (413; a malformed Content-Length is refused by the HTTP parser with 400), within BODY_READ_TIMEOUT_S (408);
    request heads: within HEAD_TIMEOUT_S of connecting or of the last answer (else the connection is closed);
  * connections: at most `max_connections` open at once; beyond them uvicorn answers 503 (the listen backlog,
    LISTEN_BACKLOG, holds a burst of connects until they are answered: none is reset);
  * claims: at most `max_waiting_claims` parked waiting for an episode, `max_claimed_episodes` claimed and not
    ended (503 beyond either, saying which);
  * rewards: a `finish` reward must be finite and within `max_abs_reward` (400 naming the bound), so one agent's
    reward can never make the buffer reject its group, the other agents' samples with it.
Loopback only, unless `allow_remote = true`; then a bearer token is required (`auth_token_file`, a file only its
owner may read, or `auth_token_env`, the name of an environment variable), and every request must carry
`Authorization: Bearer <token>` (401 otherwise). A token set on loopback is required there too.
Every refusal is answered with a JSON error saying what to change, counted by kind, and logged (the first of each
kind at WARNING, later ones at DEBUG); the endpoint stays up.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
import math
import os
import socket
import stat
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from common.config import BufferConfig, is_loopback
from common.serving import RateLimitedLog, fault_kind

if TYPE_CHECKING:
    from actors.environments.openai_server import AgentServer

log = logging.getLogger("tandem.actors.openai_server")
_faults = RateLimitedLog(log)

LISTEN_BACKLOG = 2048  # connects queued before uvicorn accepts them (the kernel caps it at net.core.somaxconn)
INLINE_PARSE_BYTES = 64 << 10  # bodies up to this size are parsed on the event loop (< 1 ms); larger: off it
BODY_READ_TIMEOUT_S = 30.0  # a body that trickles in slower than this is refused (408): it holds a connection
HEAD_TIMEOUT_S = 10.0  # a connection sends each request head within this (of connecting, or of its last answer)
START_TIMEOUT_S = 30.0
MIN_TOKEN_CHARS = 16


def buffer_reward_bound() -> float:
    """The default `max_abs_reward`: the default of the buffer's reward range (`buffer.max_abs_reward`). A run that
    lowers the buffer's bound is still safe: the episode driver holds the configured one and fails an episode past
    it (actors.environments.episodes), so the endpoint's bound is the friendly early refusal, not the only one."""
    return float(BufferConfig.model_fields["max_abs_reward"].default)


@dataclass(frozen=True)
class EndpointSettings:
    """Where the endpoint listens and what it admits: the `env.environment_args` of `AgentEnvironment`."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (read back from HttpEndpoint.port)
    allow_remote: bool = False  # bind a non-loopback host (then a token is required)
    auth_token_file: str = ""  # a file holding the bearer token, readable by its owner only
    auth_token_env: str = ""  # or the name of an environment variable holding it
    max_body_bytes: int = 16 << 20
    max_connections: int = 1024  # open connections at once (uvicorn limit_concurrency); 503 beyond
    max_waiting_claims: int = 256  # claims parked waiting for an episode; 503 beyond
    max_claimed_episodes: int = 1024  # episodes claimed and not yet ended; 503 beyond
    max_abs_reward: float = field(default_factory=buffer_reward_bound)  # |finish reward| at most this

    @classmethod
    def from_args(cls, **args: Any) -> EndpointSettings:
        """The settings from keyword arguments, each checked; ValueError naming `env.environment_args.<key>`."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ValueError(f"env.environment_args: unknown key(s) {unknown}; the endpoint takes {sorted(known)}")
        for key, value in args.items():
            _check_type(key, value, _TYPES[known[key].type])
        if "max_abs_reward" in args:
            args["max_abs_reward"] = float(args["max_abs_reward"])  # an int in TOML (100) is the same bound
        settings = cls(**args)
        settings.check()
        return settings

    def check(self) -> None:
        """ValueError naming the key when a value is out of range, or when a remote bind lacks its opt-in or token."""
        where = "env.environment_args"
        if not 0 <= self.port <= 65535:
            raise ValueError(f"{where}.port must be within 0..65535, got {self.port}")
        for key in ("max_body_bytes", "max_connections", "max_waiting_claims", "max_claimed_episodes"):
            if getattr(self, key) < 1:
                raise ValueError(f"{where}.{key} must be >= 1, got {getattr(self, key)}")
        if not (math.isfinite(self.max_abs_reward) and 0 < self.max_abs_reward <= 3.0e38):
            raise ValueError(
                f"{where}.max_abs_reward must be finite, > 0 and within float32, got {self.max_abs_reward}"
            )
        if self.auth_token_file and self.auth_token_env:
            raise ValueError(f"{where}: set auth_token_file or auth_token_env, not both")
        if is_loopback(self.host):
            return
        if not self.allow_remote:
            raise ValueError(
                f"{where}.host = {self.host!r} is not a loopback address: agents on other machines could drive "
                f"the policy; bind host = '127.0.0.1', or opt in with allow_remote = true and a token "
                "(auth_token_file or auth_token_env)"
            )
        if not (self.auth_token_file or self.auth_token_env):
            raise ValueError(
                f"{where}: allow_remote = true needs a bearer token: set auth_token_file = PATH (a file readable by "
                "its owner only) or auth_token_env = NAME (an environment variable)"
            )

    def token(self) -> str | None:
        """The bearer token every request must carry, or None (loopback without a token). Raises ValueError when
        the named file or variable is missing, readable by others, or holds fewer than MIN_TOKEN_CHARS characters."""
        if self.auth_token_file:
            where = f"env.environment_args.auth_token_file = {self.auth_token_file!r}"
            try:
                mode = os.stat(self.auth_token_file).st_mode
                with open(self.auth_token_file, encoding="utf-8") as file:
                    token = file.read().strip()
            except OSError as error:
                raise ValueError(f"{where}: cannot read it ({error.strerror})") from None
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ValueError(f"{where}: others may read it (mode {stat.S_IMODE(mode):o}): chmod 600 it")
        elif self.auth_token_env:
            where = f"env.environment_args.auth_token_env = {self.auth_token_env!r}"
            token = os.environ.get(self.auth_token_env, "").strip()
            if not token:
                raise ValueError(f"{where}: that environment variable is not set (or empty)")
        else:
            return None
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"{where}: the token has {len(token)} characters, use at least {MIN_TOKEN_CHARS}")
        return token


_TYPES = {"str": str, "int": int, "bool": bool, "float": float}  # EndpointSettings' annotations (strings here)


def _check_type(key: str, value: Any, expected: type) -> None:
    """ValueError unless `value` is an `expected` (an int for a float; a bool is no number here)."""
    if expected is bool:
        ok = isinstance(value, bool)
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, expected) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"env.environment_args.{key} must be {expected.__name__}, got {value!r}")


class Refusal(Exception):
    """A request refused with `status`; `kind` is its counter's name."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


class AgentError(RuntimeError):
    """The agent broke the protocol; the message is returned to it and ends the episode (`env_error`)."""


async def result_within(future: concurrent.futures.Future, timeout_s: float, what: str) -> Any:
    """The result of a future another thread resolves (or its exception), waited for on this event loop.

    The future is never cancelled here (a timeout leaves it to its owner, who may still resolve it);
    AgentError when it is not done within `timeout_s`."""
    wrapped = asyncio.wrap_future(future)
    done, _ = await asyncio.wait([wrapped], timeout=timeout_s)
    if not done:
        raise AgentError(f"no {what} within {timeout_s:.0f}s")
    return wrapped.result()


def checked_reward(value: Any, bound: float) -> float:
    """A finish reward: a finite number within [-bound, bound] (what the buffer admits, float32 included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"finish needs a numeric 'reward', got {value!r:.100}")
    if (isinstance(value, float) and not math.isfinite(value)) or abs(value) > bound:
        raise ValueError(
            f"reward {value!r:.40} is outside [-{bound:g}, {bound:g}] (env.environment_args.max_abs_reward, "
            "the buffer's reward range): send a finite reward within it; the episode is still open"
        )
    return float(value)


def checked_wait(value: Any, longest_s: float) -> float:
    """A claim's `wait_s`: a number of seconds within [0, longest_s]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= longest_s:
        raise ValueError(f"wait_s must be a number of seconds within [0, {longest_s:g}], got {value!r:.40}")
    return float(value)


class AgentApp:
    """The ASGI app: routes, auth, bounded bodies, errors as JSON. The episode logic is the `AgentServer`'s."""

    def __init__(self, server: AgentServer, settings: EndpointSettings) -> None:
        self.server, self.settings = server, settings
        self.token = settings.token()
        self.refused: Counter[str] = Counter()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan is off and websockets are not served
            return
        request = Request(scope, receive)
        response = await self.respond(request)
        await response(scope, receive, send)

    async def respond(self, request: Request) -> Response:
        """The answer to one request; a refusal is counted and logged, and never raises past here."""
        try:
            self.authorize(request)
            return await self.route(request)
        except Refusal as refusal:
            return self.refuse(refusal.status, refusal.kind, str(refusal))
        except (ValueError, TypeError, RecursionError) as error:  # a malformed request: say what, keep serving
            return self.refuse(400, "bad_request", str(error) or type(error).__name__)
        except LookupError as error:
            return self.refuse(404, "not_found", str(error).strip("'\""))
        except AgentError as error:
            return self.refuse(409, "conflict", str(error))
        except Exception as error:  # noqa: BLE001 - deliberately survived: a bug answers 500, the endpoint serves on
            kind = fault_kind(error)  # internal_<ExceptionName>, its traceback logged once per kind per interval
            _faults.log(logging.ERROR, kind, "the agent endpoint failed on %s", request.url.path, exc_info=error)
            return self.refuse(500, kind, f"internal error ({type(error).__name__}): see the generator's log")

    def refuse(self, status: int, kind: str, message: str) -> Response:
        self.refused[kind] += 1
        log.log(
            logging.WARNING if self.refused[kind] == 1 else logging.DEBUG,
            "agent endpoint refused a request (%d %s, %d so far): %s",
            status,
            kind,
            self.refused[kind],
            message,
        )
        headers = {"Connection": "close"} if status in (408, 413) else {}  # a body left unread: drop the connection
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        body = {"error": {"message": message, "type": "invalid_request_error", "code": kind}}
        return JSONResponse(body, status_code=status, headers=headers)

    def authorize(self, request: Request) -> None:
        if self.token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            raise Refusal(401, "unauthorized", "send the endpoint's token as 'Authorization: Bearer <token>'")

    async def route(self, request: Request) -> Response:
        parts = request.url.path.strip("/").split("/")
        if request.method == "GET" and parts == ["v1", "models"]:
            return JSONResponse({"object": "list", "data": [{"id": "tandem", "object": "model"}]})
        if request.method == "POST":
            if parts == ["v1", "chat", "completions"]:
                answer = await self.server.chat(await self.body(request), request.headers)
                return event_stream(answer) if isinstance(answer, list) else JSONResponse(answer)
            if parts == ["tandem", "episodes"]:
                return JSONResponse(await self.server.claim_request(await self.body(request)))
            if len(parts) == 4 and parts[:2] == ["tandem", "episodes"] and parts[3] == "finish":
                return JSONResponse(await self.server.finish(parts[2], await self.body(request)))
        raise LookupError(f"no such endpoint: {request.method} {request.url.path}")

    async def body(self, request: Request) -> dict[str, Any]:
        """The JSON object of the body, read up to `max_body_bytes` and no further (413), in BODY_READ_TIMEOUT_S
        (408); an empty body is {}."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise Refusal(413, "body_too_large", f"the body declares {declared} bytes, over the {limit} allowed")
        try:
            data = await asyncio.wait_for(self._read(request, limit), BODY_READ_TIMEOUT_S)
        except TimeoutError:
            raise Refusal(408, "body_timeout", f"the body did not arrive within {BODY_READ_TIMEOUT_S:g}s") from None
        # A large body is parsed on a worker thread: the event loop goes on serving the other agents meanwhile.
        if len(data) > INLINE_PARSE_BYTES:
            body = await asyncio.to_thread(json.loads, data)
        else:
            body = json.loads(data) if data else {}
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        return body

    @staticmethod
    async def _read(request: Request, limit: int) -> bytes:
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise Refusal(413, "body_too_large", f"the body is over the {limit} bytes allowed: send less")
        return bytes(data)


def event_stream(events: list[dict[str, Any]]) -> StreamingResponse:
    """Server-Sent Events as OpenAI streams them: one `data: <json>` per event, then `data: [DONE]`."""

    async def lines() -> Any:
        for event in events:
            yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request heads. uvicorn closes a connection left idle after an
    answer (timeout_keep_alive), but not one that connects and sends nothing, or sends its head a byte at a time:
    a few such clients would hold every one of `max_connections`. Here a connection that has no request being
    served HEAD_TIMEOUT_S after it connected, or after its last answer, is closed."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline = self.loop.call_later(HEAD_TIMEOUT_S, self._head_overdue)

    def on_response_complete(self) -> None:
        self._head_deadline.cancel()
        self._head_deadline = self.loop.call_later(HEAD_TIMEOUT_S, self._head_overdue)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_deadline.cancel()
        super().connection_lost(exc)

    def _head_overdue(self) -> None:
        serving = self.cycle is not None and not self.cycle.response_complete
        if not serving and not self.transport.is_closing():
            log.debug("agent endpoint: closed a connection with no request head after %gs", HEAD_TIMEOUT_S)
            self.transport.close()


class HttpEndpoint:
    """uvicorn serving `app` on its own thread. The socket is bound and listening when the constructor returns
    (OSError naming the address, e.g. a port in use, raises here), and the server has started."""

    def __init__(self, app: AgentApp, settings: EndpointSettings) -> None:
        self.socket = _listen(settings.host, settings.port)
        self.port: int = self.socket.getsockname()[1]
        config = uvicorn.Config(
            app,
            http=HeadDeadlineProtocol,  # h11, the parser uvicorn always has: the same limits and errors everywhere
            loop="asyncio",
            ws="none",
            lifespan="off",
            log_config=None,  # the process's logging stays as the role set it up
            access_log=False,
            limit_concurrency=settings.max_connections,
            backlog=LISTEN_BACKLOG,
            timeout_keep_alive=5,
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="tandem-openai", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.socket.close()
                raise RuntimeError(f"the agent endpoint on {settings.host}:{self.port} did not start: see the log")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop serving: open requests are answered or cut within uvicorn's graceful timeout (1 s)."""
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise OSError(
            error.errno, f"the agent endpoint cannot bind {host}:{port} ({error.strerror}): change env.environment_args"
        ) from None
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock
