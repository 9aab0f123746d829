"""Ports and addresses: one `run.port_base` moves every fixed port of a run, addresses left out follow the ports
they connect to, `localhost` is loopback, and a written address that reaches nothing is refused in one line."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from common.config import MAX_PORT_OFFSET, OPENAI_ENDPOINT, ConfigError, TandemConfig, load_config, write_resolved
from common.sockets import Client, Server, SocketSecurity
from common.types import Ok, VersionReport
from launch.cli import main as tandem
from launch.testing import free_port

BASE = 18100


def ports_and_addresses(config: TandemConfig) -> dict[str, object]:
    return {
        "buffer.port": config.buffer.port,
        "learner.weights_port": config.learner.weights_port,
        "weights.broadcast_port": config.weights.broadcast_port,
        "generator.buffer_address": config.generator.buffer_address,
        "learner.buffer_address": config.learner.buffer_address,
        "generator.weights_address": config.generator.weights_address,
    }


def test_one_port_base_moves_every_port_and_the_addresses_follow() -> None:
    config = load_config(None, ["--run.port_base", str(BASE), "--env.environment", OPENAI_ENDPOINT])
    assert ports_and_addresses(config) == {
        "buffer.port": BASE,
        "learner.weights_port": BASE + 1,
        "weights.broadcast_port": BASE + 2,
        "generator.buffer_address": f"127.0.0.1:{BASE}",
        "learner.buffer_address": f"127.0.0.1:{BASE}",
        "generator.weights_address": f"127.0.0.1:{BASE + 1}",
    }
    assert config.env.environment_args == {"port": BASE + 3}  # the OpenAI endpoint moves with the run


def test_without_a_base_the_ports_are_the_documented_defaults() -> None:
    config = load_config(None, ["--env.environment", OPENAI_ENDPOINT])
    assert ports_and_addresses(config) == {
        "buffer.port": 5555,
        "learner.weights_port": 5556,
        "weights.broadcast_port": 29517,
        "generator.buffer_address": "127.0.0.1:5555",
        "learner.buffer_address": "127.0.0.1:5555",
        "generator.weights_address": "127.0.0.1:5556",
    }
    assert config.env.environment_args == {}  # the endpoint's own default (8000) applies


def test_a_written_port_wins_over_the_base_and_its_addresses_follow_it(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        f'[run]\nport_base = {BASE}\n[learner]\nweights_port = 7001\n[env]\nenvironment = "{OPENAI_ENDPOINT}"\n'
        "environment_args = { port = 8123 }\n"
    )
    config = load_config(path, ["--buffer.port", "7000"])
    assert (config.buffer.port, config.learner.weights_port, config.weights.broadcast_port) == (7000, 7001, BASE + 2)
    assert config.generator.buffer_address == config.learner.buffer_address == "127.0.0.1:7000"
    assert config.generator.weights_address == "127.0.0.1:7001"
    assert config.env.environment_args == {"port": 8123}


def test_addresses_follow_the_bound_host() -> None:
    wildcard = load_config(None, {"run.insecure": True, "buffer.host": "0.0.0.0", "learner.weights_host": "*"})
    assert wildcard.generator.buffer_address == wildcard.learner.buffer_address == "127.0.0.1:5555"
    assert wildcard.generator.weights_address == "127.0.0.1:5556"  # a wildcard bind is reached on loopback here
    ipv6 = load_config(None, {"buffer.host": "::1"})
    assert ipv6.generator.buffer_address == "::1:5555"  # split at the last ':', as every role reads it
    remote = load_config(None, {"run.insecure": True, "learner.weights_host": "10.0.0.5"})
    assert remote.generator.weights_address == "10.0.0.5:5556"


def test_the_resolved_config_is_the_same_run_and_tandem_config_shows_the_addresses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = load_config(None, {"run.port_base": BASE, "run.root": str(tmp_path)})
    reloaded = load_config(write_resolved(config, config.run.run_dir), ["--generator.index", "1"])
    assert ports_and_addresses(reloaded) == ports_and_addresses(config)
    assert tandem(["config", "demo", "--run.port_base", str(BASE)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["generator"]["buffer_address"] == shown["learner"]["buffer_address"] == f"127.0.0.1:{BASE}"
    assert shown["generator"]["weights_address"] == f"127.0.0.1:{BASE + 1}"


def test_localhost_is_loopback() -> None:
    address = f"localhost:{BASE}"
    overrides = {"buffer.port": BASE, "generator.buffer_address": address, "learner.buffer_address": address}
    assert load_config(None, overrides).generator.buffer_address == address
    bound_as_localhost = load_config(None, {"buffer.host": "localhost", "learner.weights_host": "localhost"})
    assert bound_as_localhost.generator.buffer_address == "localhost:5555"
    assert load_config(None, {"generator.weights_address": "localhost:5556"}).learner.weights_host == "127.0.0.1"


def test_a_client_of_localhost_reaches_a_loopback_socket() -> None:
    port = free_port()
    server = Server("127.0.0.1", port, SocketSecurity(), name="loopback")
    replied = threading.Event()

    def answer_once() -> None:
        request = server.poll(10_000)
        if request is not None:
            server.reply(request, Ok(learner_version=request.message.policy_version))
            replied.set()

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()
    client = Client(f"localhost:{port}", SocketSecurity(), "localhost-client")
    try:
        reply, _ = client.request(VersionReport(policy_version=7, step=7), timeout_s=10)
    finally:
        client.close()
        thread.join()
        server.close()
    assert replied.is_set() and reply == Ok(learner_version=7)


@pytest.mark.parametrize(
    ("text", "key", "expected"),
    [
        ('[generator]\nbuffer_address = "127.0.0.1:7000"\n', "generator.buffer_address", "buffer 127.0.0.1:5555"),
        (
            f'[run]\nport_base = {BASE}\n[learner]\nbuffer_address = "127.0.0.1:5555"\n',  # the old default, left over
            "learner.buffer_address",
            f"buffer 127.0.0.1:{BASE}",
        ),
        (
            '[generator]\nweights_address = "10.0.0.5:5556"\n',
            "generator.weights_address",
            "the learner's publisher 127.0.0.1:5556",
        ),
        ('[generator]\nbuffer_address = "localhost:5556"\n', "generator.buffer_address", "buffer 127.0.0.1:5555"),
    ],
)
def test_a_written_address_that_reaches_nothing_is_one_line_naming_the_key(
    tmp_path: Path, text: str, key: str, expected: str
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config(path)
    message = str(error.value)
    assert message.startswith(f"{key}: ") and "\n" not in message, message
    assert f"does not reach {expected} (leave it out to follow " in message, message


def test_port_base_is_bounded_so_every_derived_port_exists() -> None:
    highest = 65535 - MAX_PORT_OFFSET  # reward.port = base + 4, the largest offset
    with pytest.raises(ConfigError, match="run.port_base"):
        load_config(None, {"run.port_base": highest + 1})
    config = load_config(None, {"run.port_base": highest})
    assert config.reward.port == 65535 and config.weights.broadcast_port == highest + 2
