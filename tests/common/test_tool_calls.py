"""Hermes tool calls (common/tool_calls.py): checking tool lists, the prompt block, parsing turns, running tools."""

from __future__ import annotations

import json
import re
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.tool_calls import (
    Toolbox,
    ToolCall,
    check_tools,
    parse_tool_calls,
    tool_message,
    tools_system_prompt,
    with_tools,
)

SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
CALC = {"type": "function", "function": {"name": "calculate", "description": "Arithmetic.", "parameters": SCHEMA}}

names = st.text(string.ascii_letters + "_", min_size=1, max_size=12)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
# text outside blocks: anything without a '<' (so it cannot open or close a block itself)
plain = st.text(st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), max_size=30)


def block(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


# -------------------------------------------------------------------------------------------------- check_tools
def test_check_tools_normalises():
    (tool,) = check_tools([{"type": "function", "function": {"name": "now", "strict": True}}])
    assert tool == {
        "type": "function",
        "function": {"name": "now", "description": "", "parameters": {"type": "object", "properties": {}}},
    }
    assert check_tools([CALC]) == [CALC] and check_tools([CALC])[0] is not CALC


@pytest.mark.parametrize(
    ("tools", "error", "says"),
    [
        ({"type": "function"}, TypeError, "must be a list"),
        ([{"type": "tool", "function": {"name": "a"}}], TypeError, "tools[0] must be"),
        ([{"type": "function", "function": {"name": "2fast"}}], ValueError, "function.name must match"),
        ([{"type": "function", "function": {"name": "a b"}}], ValueError, "function.name must match"),
        ([CALC, CALC], ValueError, "declared twice"),
        (
            [{"type": "function", "function": {"name": "a", "parameters": {"type": "string"}}}],
            TypeError,
            "JSON schema object",
        ),
        (
            [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "required": "x"}}}],
            ValueError,
            "not a valid JSON schema",
        ),
        (
            [{"type": "function", "function": {"name": "a", "description": 3}}],
            TypeError,
            "description must be a string",
        ),
    ],
)
def test_check_tools_says_what_to_change(tools, error, says):
    with pytest.raises(error, match=re.escape(says)):
        check_tools(tools)


# ------------------------------------------------------------------------------------------------ prompt block
def test_tools_system_prompt_is_the_hermes_block():
    text = tools_system_prompt([CALC])
    inside = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in inside.splitlines()] == [CALC]
    assert text.startswith("# Tools\n\n") and text.endswith('"arguments": <args-json-object>}\n</tool_call>')


def test_with_tools_appends_to_system_or_adds_one():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2*3?"}]
    out = with_tools(chat, [CALC])
    assert out[0]["content"] == "Be brief.\n\n" + tools_system_prompt([CALC]) and out[1:] == chat[1:]
    assert chat[0]["content"] == "Be brief."  # the input is not changed
    added = with_tools(chat[1:], [CALC])
    assert added == [{"role": "system", "content": tools_system_prompt([CALC])}, chat[1]]
    assert with_tools(chat, []) == chat


# ------------------------------------------------------------------------------------------------------ parsing
@given(st.lists(st.tuples(plain, names, arguments), max_size=4), plain)
def test_round_trip_calls_and_content(parts, tail):
    text = "".join(before + block(name, args) for before, name, args in parts) + tail
    turn = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in turn.calls] == [(name, args) for _, name, args in parts]
    assert turn.content == ("".join(before for before, _, _ in parts) + tail).strip()
    assert turn.errors == []
    assert parse_tool_calls(text) == turn  # deterministic ids
    assert len({c.id for c in turn.calls}) == len(turn.calls)
    for call in turn.calls:
        entry = call.to_openai()
        assert entry["type"] == "function" and json.loads(entry["function"]["arguments"]) == call.arguments


@given(names, arguments)
def test_arguments_as_a_json_string(name, args):
    text = "<tool_call>" + json.dumps({"name": name, "arguments": json.dumps(args)}) + "</tool_call>"
    (call,) = parse_tool_calls(text).calls
    assert call.arguments == args


def test_absent_arguments_are_empty():
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>').calls[0].arguments == {}


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("{name: calculate}", "not valid JSON"),
        ('["calculate"]', "expected a JSON object"),
        ('{"arguments": {}}', "'name' must be a non-empty string"),
        ('{"name": 3, "arguments": {}}', "'name' must be a non-empty string"),
        ('{"name": "f", "arguments": [1]}', "must be a JSON object"),
        ('{"name": "f", "arguments": "not json"}', "string that is not JSON"),
        ('{"name": "f", "arguments": "[1]"}', "must be a JSON object"),
    ],
)
def test_malformed_block_is_an_error_not_an_exception(body, says):
    text = "Let me see. <tool_call>" + body + "</tool_call> " + block("ok", {"x": 1})
    turn = parse_tool_calls(text)
    assert [c.name for c in turn.calls] == ["ok"]
    assert len(turn.errors) == 1 and says in turn.errors[0] and turn.errors[0].startswith("tool call 0:")
    assert turn.content == "Let me see."
    assert turn.calls[0].id.startswith("call_1_")  # positions count the malformed block


def test_unclosed_block_is_an_error_and_leaves_content():
    turn = parse_tool_calls("Sure. " + block("a", {}) + ' then <tool_call>{"name": "calculate", "argum')
    assert [c.name for c in turn.calls] == ["a"]
    assert turn.errors == ["tool call 1: <tool_call> is never closed with </tool_call> (turn cut short?)"]
    assert turn.content == "Sure.  then"


def test_stray_closing_tag_stays_in_content_and_prefix_sets_ids():
    turn = parse_tool_calls("done </tool_call>", id_prefix="t3")
    assert turn == parse_tool_calls("done </tool_call>") and turn.content == "done </tool_call>"
    assert parse_tool_calls(block("a", {}), id_prefix="t3").calls[0].id.startswith("t3_0_")


def test_tool_message():
    call = ToolCall("call_0_x", "calculate", {"expression": "1"})
    assert tool_message(call, "1") == {"role": "tool", "tool_call_id": "call_0_x", "name": "calculate", "content": "1"}


# ------------------------------------------------------------------------------------------------------ Toolbox
def make_box() -> Toolbox:
    box = Toolbox()

    def calculate(expression: str) -> str:
        if expression == "boom":
            raise ZeroDivisionError("division by zero")
        return "6" if expression == "2*3" else "?"

    box.register(calculate, SCHEMA, "Arithmetic.")
    box.register(lambda: {"h": 12}, {"type": "object", "properties": {}, "additionalProperties": False}, name="now")
    return box


def test_toolbox_lists_and_runs_tools():
    box = make_box()
    assert [t["function"]["name"] for t in box.tools] == ["calculate", "now"] and box.tools[0] == CALC
    assert box.run(ToolCall("c", "calculate", {"expression": "2*3"})) == box.run(
        ToolCall("d", "calculate", {"expression": "2*3"})
    )
    assert box.run(ToolCall("c", "calculate", {"expression": "2*3"})).ok
    assert box.call(ToolCall("c", "calculate", {"expression": "2*3"})) == "6"
    assert box.call(ToolCall("c", "now", {})) == '{"h": 12}'


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (ToolCall("c", "search", {}), "error: unknown tool 'search'; the tools are: calculate, now"),
        (ToolCall("c", "calculate", {}), "error: bad arguments for calculate: 'expression' is a required property"),
        (
            ToolCall("c", "calculate", {"expression": 6}),
            "error: bad arguments for calculate: 6 is not of type 'string' (at expression)",
        ),
        (ToolCall("c", "now", {"tz": "UTC"}), "error: bad arguments for now: Additional properties are not allowed"),
        (
            ToolCall("c", "calculate", {"expression": "boom"}),
            "error: calculate failed: ZeroDivisionError: division by zero",
        ),
    ],
)
def test_toolbox_errors_are_text_for_the_model(call, says):
    result = make_box().run(call)
    assert not result.ok and result.content.startswith(says)


def test_toolbox_register_refuses_bad_schema_and_duplicates():
    box = make_box()
    with pytest.raises(ValueError, match="registered twice"):
        box.register(lambda expression: expression, SCHEMA, name="calculate")
    with pytest.raises(TypeError, match="JSON schema object"):
        box.register(lambda: 1, {"type": "array"}, name="x")
