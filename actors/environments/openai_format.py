"""OpenAI chat-completions shapes for the agent endpoint (actors/environments/openai_server.py): messages in, replies out.

    messages = agent_messages(body["messages"])          # checked; canonical dicts (comparable with the record)
    tools = request_tools(body)                          # None, or the checked list (common.tool_calls)
    reply = model_reply(text, tools, turn, counts)       # the model's turn: message, finish_reason, usage
    completion(reply)                                    # a chat.completion
    chunks(reply, include_usage=True)                    # the chat.completion.chunk events of a stream

Messages. A request's messages are checked here and kept in a canonical form: `role` and `content` (a string; an
assistant message's null content is ""), plus `tool_calls` on an assistant message (each `{"id", "type":
"function", "function": {"name", "arguments"}}`, arguments a JSON string) and `tool_call_id`/`name` on a tool
message. Keys that are null or empty (what the `openai` client echoes back from a returned message: `refusal`,
`audio`, `function_call`, `annotations`, `tool_calls: null`) are dropped, so the model's reply sent back as the
client serialises it (`completion.choices[0].message`, or its `model_dump()`) equals the recorded turn.

Replies. With tools declared, the model's Hermes `<tool_call>` blocks are parsed (common.tool_calls): the message
carries them as `tool_calls` and `content` is the text outside the blocks (null when empty, as OpenAI sends it). A
turn with no well-formed call is returned as its whole text (malformed blocks included, as vLLM's Hermes parser
does), so the agent sees what the model wrote. `finish_reason`: "length" when the turn was cut by its max_tokens,
else "tool_calls" when it made calls, else "stop". `usage`: the turn's true counts, prompt_tokens being the whole
context the model was given (the episode so far, tools block included).

Streaming. The engine generates a turn as a whole, so a stream is the finished turn cut into OpenAI's chunks (a role
chunk, a content chunk, one chunk per tool call with its whole arguments, a final chunk with the finish_reason, and
with `stream_options.include_usage` a last chunk with no choices and the usage, the others carrying `usage: null`),
sent at once when the turn is done: the same events a client accumulates, none of them early.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.tool_calls import check_tools, parse_tool_calls

MODEL_NAME = "tandem"
_SENT_BACK = ("refusal", "audio", "function_call", "annotations", "tool_calls")  # null keys a client may echo


@dataclass(frozen=True)
class TurnCounts:
    """What the episode driver reports of one model turn (AgentEnvironment.on_model_turn)."""

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # the engine's: "stop" or "length"


@dataclass(frozen=True)
class ModelReply:
    """The model's turn as the API returns it; `record` is its canonical form (what a later request must repeat)."""

    message: dict[str, Any]
    finish_reason: str
    usage: dict[str, int] | None
    record: dict[str, Any]


def agent_messages(value: Any, what: str = "messages") -> list[dict[str, Any]]:
    """The messages of a request, checked and canonical (module docstring); TypeError/ValueError naming the first bad
    one and what to change."""
    if not isinstance(value, list):
        raise TypeError(f"{what} must be a list of chat messages, got {type(value).__name__}")
    return [_message(message, f"{what}[{i}]") for i, message in enumerate(value)]


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise TypeError(f"{where} must be a dict with a string 'role', got {message!r:.200}")
    role, content, calls = message["role"], message.get("content"), message.get("tool_calls")
    if calls and role != "assistant":
        raise ValueError(f"{where}: only an assistant message may carry tool_calls, this one's role is {role!r}")
    if not isinstance(content, str) and not (content is None and calls):
        raise TypeError(
            f"{where}.content must be a string (null only beside an assistant's tool_calls), got {content!r:.200}"
        )
    canonical: dict[str, Any] = {"role": role, "content": content or ""}
    if calls:
        canonical["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise TypeError(f"{where}.{key} must be a string, got {message[key]!r:.80}")
            canonical[key] = message[key]
    unknown = sorted(k for k, v in message.items() if k not in canonical and v is not None and k not in _SENT_BACK)
    if unknown:
        raise ValueError(f"{where}: unsupported key(s) {unknown}: send role, content, tool_calls, tool_call_id, name")
    return canonical


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise TypeError(f"{where} must be a list, got {type(calls).__name__}")
    canonical = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not (
            isinstance(function, Mapping)
            and isinstance(call.get("id"), str)
            and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments"), str)
        ):
            raise TypeError(
                f"{where}[{i}] must be {{'id': str, 'type': 'function', 'function': {{'name': str, 'arguments': "
                f"str}}}} (as the endpoint returned it), got {call!r:.200}"
            )
        entry = {"name": function["name"], "arguments": function["arguments"]}
        canonical.append({"id": call["id"], "type": "function", "function": entry})
    return canonical


def template_messages(messages: list[dict[str, Any]], where: str) -> list[dict[str, str]]:
    """Canonical messages as the chat template renders them (what the episode driver gets); ValueError for an
    assistant message with tool_calls: only the model's own turns carry them, and those are never re-rendered."""
    for i, message in enumerate(messages):
        if "tool_calls" in message:
            raise ValueError(
                f"{where}[{i}] is an assistant message with tool_calls that the model did not write: only the model's "
                "replies (repeated as returned) may carry tool_calls"
            )
    return [dict(message) for message in messages]


def request_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The request's `tools` checked (common.tool_calls.check_tools; its TypeError/ValueError says what is wrong),
    or None when it has none."""
    tools = body.get("tools")
    return check_tools(tools) if tools else None


def stream_request(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage) of a request; ValueError for a non-boolean or stream_options without stream."""
    stream, options = body.get("stream", False), body.get("stream_options")
    if not isinstance(stream, bool) and stream is not None:
        raise ValueError(f"stream must be true or false, got {stream!r:.40}")
    if options is None:
        return bool(stream), False
    if not stream:
        raise ValueError("stream_options is only allowed with stream = true")
    include = options.get("include_usage", False) if isinstance(options, Mapping) else None
    if not isinstance(include, bool):
        raise ValueError(f"stream_options must be {{'include_usage': true|false}}, got {options!r:.80}")
    return True, include


def model_reply(text: str, tools: list[dict[str, Any]] | None, turn: int, counts: TurnCounts | None) -> ModelReply:
    """The model's turn `text` (its `turn`-th, from 0) as the API returns it (module docstring). Call ids are
    `call_<turn>_<k>_<digest>`: unique within the episode. `counts` None: usage null (no driver reported them)."""
    parsed = parse_tool_calls(text, id_prefix=f"call_{turn}") if tools else None
    if parsed is not None and parsed.calls:
        calls = [call.to_openai() for call in parsed.calls]
        message = {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}
    else:
        message = {"role": "assistant", "content": text}
    cut = counts is not None and counts.finish_reason == "length"
    finish = "length" if cut else ("tool_calls" if "tool_calls" in message else "stop")
    usage = None
    if counts is not None:
        total = counts.prompt_tokens + counts.completion_tokens
        usage = {"prompt_tokens": counts.prompt_tokens, "completion_tokens": counts.completion_tokens}
        usage["total_tokens"] = total
    return ModelReply(message, finish, usage, _message(message, "the model's reply"))


def completion(reply: ModelReply) -> dict[str, Any]:
    """A `chat.completion` answering with `reply`."""
    return {
        **_head("chat.completion"),
        "choices": [{"index": 0, "message": reply.message, "finish_reason": reply.finish_reason}],
        "usage": reply.usage,
    }


def chunks(reply: ModelReply, include_usage: bool) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` events streaming `reply` (module docstring), without the final `[DONE]`."""
    head = _head("chat.completion.chunk")
    message = reply.message
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    if message["content"]:
        deltas.append({"content": message["content"]})
    for index, call in enumerate(message.get("tool_calls", [])):
        deltas.append({"tool_calls": [{"index": index, **call}]})
    events = [{**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]} for delta in deltas]
    events.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish_reason}]})
    if include_usage:
        events = [{**event, "usage": None} for event in events]
        events.append({**head, "choices": [], "usage": reply.usage})
    return events


def _head(kind: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-{secrets.token_hex(8)}", "object": kind, "created": int(time.time()), "model": MODEL_NAME}
