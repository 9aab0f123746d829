"""The OpenAI-endpoint example: examples/openai_agent.toml and examples/agents/arithmetic_agent.py, as documented.

The config is what `tandem config` accepts and what the generator builds its environment and limits from; the
agent program (the stock `openai` client) runs the episodes against the real endpoint, on a free loopback port,
while the episode driver samples on a policy engine with SmolLM2's chat template (in a thread, as the generator's
loop does). Checked: the agent's rewards (1.0 right at once, 0.5 right after its feedback) reach the samples,
every episode ends `done`, and the documented commands agree (the agent's defaults fit the config).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from actors.environments.episodes import EpisodeDriver, EpisodeLimits
from actors.environments.openai_server import AgentServer
from actors.environments.runner import EnvRunner
from common.config import load_config
from common.envs import environment_factory
from common.tasks import arithmetic_prompts
from common.types import PromptItem
from examples.agents import arithmetic_agent
from launch.cli import main as tandem
from launch.testing import drive_until_done, free_port

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "openai_agent.toml"
QUESTION = re.compile(r"What is ([^?]+)\?")


def test_tandem_config_accepts_the_example_and_the_agents_defaults_fit_it(capsys) -> None:
    assert tandem(["config", str(CONFIG)]) == 0
    assert '"environment": "actors.environments.openai_server:AgentEnvironment"' in capsys.readouterr().out
    config = load_config(CONFIG)
    args = config.env.environment_args
    parsed = arithmetic_agent.parser().parse_args([])
    assert parsed.url == f"http://{args['host']}:{args['port']}"
    assert parsed.attempts == config.env.max_turns
    assert parsed.concurrency == config.generator.prompts_in_flight * config.algo.group_size


@pytest.mark.parametrize(
    ("reply", "answer"),
    [("#### 7", 7.0), ("3 + 4 = 7.\n#### 7\nso 8", 7.0), ("It is 12, not 13", 13.0), ("-3", -3.0), ("none", None)],
)
def test_the_agent_reads_the_final_answer(reply: str, answer: float | None) -> None:
    assert arithmetic_agent.final_answer(reply) == answer


def test_the_example_agent_runs_episodes_through_the_endpoint(tiny_model_dir, capsys) -> None:
    """Policy: right at once when the answer is odd, else wrong, then right after the agent's feedback."""
    from transformers import AutoTokenizer

    from tests.actors.env_fakes import PolicyEngine

    port = free_port()
    base = load_config(CONFIG)
    config = load_config(CONFIG, {"env.environment_args": {**base.env.environment_args, "port": port}})
    records = arithmetic_prompts(4, seed=config.run.seed, difficulty=config.env.difficulty)
    answers = {r.metadata["expression"]: r.metadata["answer"] for r in records}
    assert {a % 2 for a in answers.values()} == {0, 1}  # both kinds of episode occur

    def policy(conversation: str) -> str:
        answer = answers[QUESTION.findall(conversation)[-1]]
        right = answer % 2 == 1 or arithmetic_agent.FEEDBACK in conversation
        return f"#### {answer if right else answer + 1}"

    engine = PolicyEngine(AutoTokenizer.from_pretrained(tiny_model_dir), policy)
    runner = EnvRunner(config.env.env_workers)
    factory = environment_factory(config.env)  # the generator's start-up: the endpoint is up from here
    groups: list = []
    try:
        driver = EpisodeDriver(engine, factory, EpisodeLimits.from_config(config), runner, config.algo.group_size)
        for record in records:
            driver.start_group(0, PromptItem(record.prompt_id, 0, record.messages, record.metadata))
        loop = threading.Thread(target=lambda: groups.extend(drive_until_done(driver, timeout_s=60)), daemon=True)
        loop.start()
        episodes = len(records) * config.algo.group_size
        agent_argv = ["--url", f"http://127.0.0.1:{port}", "--episodes", str(episodes), "--concurrency", "8"]
        assert arithmetic_agent.main(agent_argv) == 0
        loop.join(timeout=60)
    finally:
        runner.close()
        AgentServer.shared(**config.env.environment_args).close()
    assert len(groups) == len(records)
    for group in groups:
        answer = group.prompt.metadata["answer"]
        assert [r.finish_reason for r in group.results] == ["done"] * config.algo.group_size
        assert {r.reward for r in group.results} == {1.0 if answer % 2 else 0.5}
        assert {r.turns for r in group.results} == {1 if answer % 2 else 2}
    odd = sum(a % 2 for a in answers.values()) * config.algo.group_size
    assert capsys.readouterr().out.strip() == (f"{episodes} episodes: {episodes - odd} reward 0.5, {odd} reward 1.0")
