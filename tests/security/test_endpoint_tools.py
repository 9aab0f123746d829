"""Issue 37, item 6 (OpenAI endpoint): no one request holds the event loop. Before the fix one chat request with a
13 MB list of 5,000 tools was checked on the event loop for 89 s while every other agent waited. Now a tool list is
bounded (count and JSON size, refused with 400 naming the limit before any schema is checked) and large bodies
are parsed and checked on a worker thread.
"""

from __future__ import annotations

import json
import threading
import time

from actors.environments.openai_server import EPISODE_HEADER, AgentEnvironment, AgentServer
from common.tool_calls import MAX_TOOLS, MAX_TOOLS_CHARS, check_tools
from launch.testing import free_port
from tests.security.test_endpoint_attacks import error_message, request, serving


def tool(i: int, description_chars: int = 2000) -> dict:
    properties = {f"arg{j}": {"type": "string", "description": "an argument " * 4} for j in range(8)}
    return {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "d" * description_chars,
            "parameters": {"type": "object", "properties": properties, "required": ["arg0"]},
        },
    }


def test_the_endpoint_answers_other_agents_while_a_5000_tool_request_is_checked() -> None:
    port = free_port()
    server = AgentServer.shared("127.0.0.1", port)
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool(i) for i in range(5000)]}
    assert len(json.dumps(body)) > 12_000_000  # the 13 MB of the report
    answer: dict = {}
    try:
        attacker = threading.Thread(
            target=lambda: answer.setdefault(
                "reply", request(port, "POST", "/v1/chat/completions", body, **{EPISODE_HEADER: "any"})
            ),
            daemon=True,
        )
        attacker.start()
        slowest = 0.0
        for _ in range(10):  # another agent, meanwhile
            started = time.monotonic()
            assert serving(port)
            slowest = max(slowest, time.monotonic() - started)
        attacker.join(timeout=30)
        status, reply = answer["reply"]
        assert status == 400 and f"at most {MAX_TOOLS} may be declared" in error_message(reply)
        assert slowest < 2.0
        # the refusal is counted where the generator's metrics read it (common.envs: process_metrics)
        metrics = AgentEnvironment.process_metrics()
        assert (
            metrics["env/endpoint_refused"] >= 1
            and sum(value for key, value in metrics.items() if key.startswith("env/endpoint_refused_"))
            == metrics["env/endpoint_refused"]
        )
    finally:
        server.close()


def test_a_tool_list_is_bounded_by_its_json_size_before_any_schema_is_checked() -> None:
    few_but_huge = [tool(i, description_chars=MAX_TOOLS_CHARS // 4) for i in range(8)]
    started = time.monotonic()
    try:
        check_tools(few_but_huge)
    except ValueError as error:
        assert f"passes {MAX_TOOLS_CHARS} characters" in str(error)
    else:
        raise AssertionError("a tool list over MAX_TOOLS_CHARS was accepted")
    assert time.monotonic() - started < 1.0
    assert len(check_tools([tool(i, 100) for i in range(MAX_TOOLS)])) == MAX_TOOLS  # at the count bound: accepted
