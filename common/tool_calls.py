"""Tool calls in the Hermes format of ChatML models (Qwen2.5, Hermes, SmolLM2): declare, prompt, parse, run.

    tools = check_tools([{"type": "function", "function": {"name": "calculate", "description": "...",
                          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                         "required": ["expression"]}}}])
    chat = with_tools(task.messages, tools)            # the <tools> block joins the system message
    ...the model answers...
    turn = parse_tool_calls(text)                       # ParsedTurn(content, calls, errors)
    replies = [tool_message(call, toolbox.call(call)) for call in turn.calls]

The format (what Qwen2.5's chat template writes when given `tools`): the system message ends with

    # Tools
    ... <tools>
    {"type": "function", "function": {...}}            one JSON object per line, one line per tool
    </tools>
    ... <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

and the model calls a tool by writing `<tool_call>{"name": "calculate", "arguments": {"expression": "2*3"}}</tool_call>`
anywhere in its turn, once per call. These tags are plain text in SmolLM2's vocabulary (no special tokens), so a
decoded turn keeps them.

Tool results: `tool_message` makes `{"role": "tool", "tool_call_id", "name", "content"}`. SmolLM2's chat template is
generic ChatML: it writes any role verbatim, so a tool message renders as `<|im_start|>tool\\n<content><|im_end|>\\n`
(`actors.environments.chat_turns.ChatTurnRenderer.render_turn` gives exactly that delta after a model turn) and drops
`tool_call_id` and `name` (`common.envs.check_messages` keeps them, for templates that render them). The 135M model was not
trained on a `tool` role, so put what the model needs to read into `content` itself (`tool_message` does not add the
tool's name). Qwen2.5's template instead renders tool messages as a user turn wrapped in `<tool_response>` tags.

Importing this module is cheap (no torch, no tokenizer); `jsonschema` (a core dependency) is imported on first use.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TOOL_NAME = re.compile(
    r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$"
)  # OpenAI's rule (a-z, A-Z, 0-9, _ and -, <= 64), no leading digit
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# Bounds on a tool list (checked before any schema is: a 13 MB list of 5,000 tools took 89 s to check). OpenAI's API
# takes at most 128 tools; their JSON, all together, is what every prompt of the episode carries.
MAX_TOOLS = 128
MAX_TOOLS_CHARS = 256 << 10

_PROMPT_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_PROMPT_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """An OpenAI-format tool list, checked and normalised (deep copies; `description` "" and `parameters` an empty
    object schema when absent; other keys of `function`, e.g. `strict`, dropped).

    Each entry: `{"type": "function", "function": {"name", "description", "parameters"}}`; names unique and
    identifier-like (TOOL_NAME); `parameters` a valid JSON schema whose `type` is "object"; at most MAX_TOOLS of
    them, MAX_TOOLS_CHARS of JSON in all (measured before any schema is checked). TypeError/ValueError naming the
    entry or the limit and what to change.
    """
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(
            f"tools must be a list of {{'type': 'function', 'function': {{...}}}}, got {type(tools).__name__}"
        )
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"{len(tools)} tools: at most {MAX_TOOLS} may be declared (send the ones this task needs)")
    chars = 0
    for i, tool in enumerate(tools):
        chars += len(json.dumps(tool, ensure_ascii=False, default=repr))
        if chars > MAX_TOOLS_CHARS:
            raise ValueError(
                f"tools[{i}]: the tools' JSON passes {MAX_TOOLS_CHARS} characters, the most a tool list may hold "
                "(shorten the descriptions and schemas, or declare fewer tools)"
            )
    checked, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), Mapping)
        ):
            raise TypeError(
                f"{where} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}, got {tool!r:.200}"
            )
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ValueError(
                f"{where}.function.name must match {TOOL_NAME.pattern} (letters, digits, _ or -), got {name!r}"
            )
        if name in seen:
            raise ValueError(f"{where}.function.name {name!r} is declared twice: tool names must be unique")
        seen.add(name)
        description = function.get("description", "")
        if not isinstance(description, str):
            raise TypeError(f"{where}.function.description must be a string, got {type(description).__name__}")
        parameters = check_parameters(function.get("parameters", EMPTY_PARAMETERS), f"{where}.function.parameters")
        checked.append(
            {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
        )
    return checked


def check_parameters(schema: Any, what: str = "parameters") -> dict[str, Any]:
    """A deep copy of `schema` if it is a valid JSON schema of an object (`{"type": "object", ...}`), else
    TypeError/ValueError naming `what`."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        raise TypeError(
            f"{what} must be a JSON schema object like {{'type': 'object', 'properties': {{...}}}}, got {schema!r:.200}"
        )
    schema = copy.deepcopy(dict(schema))
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as error:
        raise ValueError(
            f"{what} is not a valid JSON schema: {error.message} (at {'/'.join(map(str, error.path)) or 'top'})"
        ) from None
    return schema


def tools_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The Hermes/Qwen2.5 instruction block for these tools (checked with `check_tools`): the `<tools>` list, one
    JSON object per line, and how to call one with `<tool_call>`."""
    lines = [json.dumps(tool, ensure_ascii=False) for tool in check_tools(tools)]
    return _PROMPT_HEAD + "".join("\n" + line for line in lines) + _PROMPT_TAIL


def with_tools(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The chat with the tools block appended to its system message (after a blank line), or, when it has none,
    a new first system message holding the block. No tools: the chat unchanged (as a new list of copies)."""
    chat = [dict(message) for message in messages]
    if not tools:
        return chat
    block = tools_system_prompt(tools)
    if chat and chat[0].get("role") == "system":
        system = str(chat[0].get("content") or "")
        chat[0]["content"] = f"{system}\n\n{block}" if system else block
    else:
        chat.insert(0, {"role": "system", "content": block})
    return chat


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `id` (deterministic, see `parse_tool_calls`), the tool's `name`, its `arguments` object."""

    id: str
    name: str
    arguments: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry; `arguments` as a JSON string (what the API sends)."""
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn split: `content` (the text outside the call blocks, stripped), the well-formed `calls` in order,
    and one `errors` entry per malformed or unclosed block (saying what was wrong, for the model or the metrics)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def parse_tool_calls(text: str, id_prefix: str = "call") -> ParsedTurn:
    """The Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of a model turn.

    A block's body is JSON: an object with a string `name` and an `arguments` object (a JSON string holding an
    object is accepted too; absent means `{}`). Anything else is an error entry, never an exception; so is an
    opening tag left unclosed (a turn cut by max_tokens), whose text is then dropped from `content`. A stray closing
    tag stays in `content`. Call ids are `{id_prefix}_{k}_{digest}`, k the block's position (counting malformed ones)
    and digest 8 hex digits of its body: the same text always parses to the same ids; pass a per-turn `id_prefix`
    where ids must be unique across the turns of a chat.
    """
    calls, errors, outside, end = [], [], [], 0
    for k, match in enumerate(_BLOCK.finditer(text)):
        outside.append(text[end : match.start()])
        end = match.end()
        body = match.group(1)
        try:
            name, arguments = _call_fields(body)
        except ValueError as error:
            errors.append(f"tool call {k}: {error}")
            continue
        digest = hashlib.sha256(body.encode()).hexdigest()[:8]
        calls.append(ToolCall(f"{id_prefix}_{k}_{digest}", name, arguments))
    rest = text[end:]
    cut = rest.find(CALL_OPEN)
    if cut >= 0:
        errors.append(
            f"tool call {len(calls) + len(errors)}: {CALL_OPEN} is never closed with {CALL_CLOSE} (turn cut short?)"
        )
        rest = rest[:cut]
    outside.append(rest)
    return ParsedTurn("".join(outside).strip(), calls, errors)


def _call_fields(body: str) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of one block's body; ValueError saying what is wrong."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error.msg} at character {error.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object with 'name' and 'arguments', got {type(value).__name__}")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"'name' must be a non-empty string, got {name!r:.80}")
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise ValueError(f"'arguments' of {name} is a string that is not JSON: {arguments!r:.80}") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"'arguments' of {name} must be a JSON object, got {type(arguments).__name__}")
    return name, arguments


def tool_message(call: ToolCall, content: str) -> dict[str, str]:
    """The `tool` message answering `call` (OpenAI shape). How SmolLM2's template renders it: module docstring."""
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": str(content)}


@dataclass(frozen=True)
class ToolResult:
    """What running a call gave: `content` (the function's result, or an error text for the model) and `ok`
    (the tool existed, the arguments fit its schema and the function returned)."""

    content: str
    ok: bool


@dataclass(frozen=True)
class _Registered:
    fn: Callable[..., Any]
    spec: dict[str, Any]  # the OpenAI-format entry


class Toolbox:
    """Python functions as tools: each registered with its JSON schema, called with keyword arguments.

        box = Toolbox()
        box.register(calculate, parameters={"type": "object", "properties": {"expression": {"type": "string"}},
                                            "required": ["expression"]}, description="Evaluate arithmetic.")
        chat = with_tools(chat, box.tools)
        text = box.call(call)          # the result as text, or "error: ..." the model can read

    `register` checks the schema (ValueError/TypeError); `run`/`call` never raise for the model's mistakes.
    """

    def __init__(self) -> None:
        self._tools: dict[str, _Registered] = {}

    def register(
        self,
        fn: Callable[..., Any],
        parameters: Mapping[str, Any],
        description: str = "",
        name: str | None = None,
    ) -> Callable[..., Any]:
        """Add `fn` as the tool `name` (default `fn.__name__`); returns `fn`. ValueError for a name taken or a bad
        schema."""
        name = name or fn.__name__
        spec = {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
        (spec,) = check_tools([spec])
        if name in self._tools:
            raise ValueError(f"tool {name!r} is registered twice: pick another name")
        self._tools[name] = _Registered(fn, spec)
        return fn

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The OpenAI-format list of the registered tools, in registration order (for `with_tools`)."""
        return [copy.deepcopy(tool.spec) for tool in self._tools.values()]

    def run(self, call: ToolCall) -> ToolResult:
        """Run `call`: its result (a string as is, anything else as JSON) or an error text saying what went wrong:
        an unknown tool (and the known ones), arguments that break the schema (which and why), or the function
        raising (its exception type and message)."""
        from jsonschema.validators import validator_for

        tool = self._tools.get(call.name)
        if tool is None:
            known = ", ".join(self._tools) or "none"
            return ToolResult(f"error: unknown tool {call.name!r}; the tools are: {known}", False)
        schema = tool.spec["function"]["parameters"]
        problems = sorted(validator_for(schema)(schema).iter_errors(call.arguments), key=lambda e: list(e.path))
        if problems:
            where = "/".join(map(str, problems[0].path))
            return ToolResult(
                f"error: bad arguments for {call.name}: {problems[0].message}" + (f" (at {where})" if where else ""),
                False,
            )
        try:
            value = tool.fn(**call.arguments)
        except Exception as error:  # noqa: BLE001 - the tool's fault is reported to the model, not raised
            return ToolResult(f"error: {call.name} failed: {type(error).__name__}: {error}", False)
        return ToolResult(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str), True)

    def call(self, call: ToolCall) -> str:
        """`run(call).content`."""
        return self.run(call).content
