"""Plug-ins (reward functions, environments) import by one rule, whatever the launcher and the working directory:
from the config file's folder, then `env.plugin_paths` (relative to that folder), then the current directory,
recorded as absolute folders in the resolved config that every role of a run reads."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from common.config import load_config, plugin_search_path, write_resolved
from common.envs import environment_factory, resolve_environment
from common.plugins import resolve_callable
from common.tasks import resolve_reward_fn

REWARDS = "def exact_match(completion, metadata):\n    return float(completion == metadata['answer'])\n"
ENVIRONMENT = (
    "from common.envs import StepResult\n"
    "class Echo:\n"
    "    def reset(self, task):\n        return task.messages\n"
    "    def step(self, text):\n        return StepResult([], reward=1.0, done=True)\n"
)


@pytest.fixture
def clean_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The resolver edits sys.path and imports modules named `beside_*` from tmp folders: undo both afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    for name in [name for name in sys.modules if name.startswith("beside_")]:
        del sys.modules[name]


def layout(tmp_path: Path, toml: str = "[run]\n") -> tuple[Path, Path]:
    """tmp/project/run.toml (with `toml`) and tmp/elsewhere, the working directory of the role."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "run.toml").write_text(toml)
    return project / "run.toml", elsewhere


def test_the_search_path_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_path, elsewhere = layout(tmp_path)
    monkeypatch.chdir(elsewhere)
    project = str(config_path.parent)
    assert plugin_search_path([], config_path) == [project, str(elsewhere)]
    assert plugin_search_path(["lib", "../shared", "/opt/plugins", "."], config_path) == [
        project,
        f"{project}/lib",
        str(tmp_path / "shared"),  # relative entries start at the config's folder
        "/opt/plugins",
        str(elsewhere),
    ]
    assert plugin_search_path(["lib"], None) == [str(elsewhere / "lib"), str(elsewhere)]  # no file: the cwd
    resolved = tmp_path / "runs" / "x" / "config.json"
    assert plugin_search_path([project, str(elsewhere)], resolved) == [project, str(elsewhere)]  # kept as written


def test_the_resolved_config_records_the_users_folders_not_the_run_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_path, elsewhere = layout(tmp_path, '[env]\nplugin_paths = ["lib"]\n')
    monkeypatch.chdir(elsewhere)
    config = load_config(config_path, {"run.root": str(tmp_path / "runs")})
    expected = [str(config_path.parent), str(config_path.parent / "lib"), str(elsewhere)]
    assert config.env.plugin_paths == expected
    written = write_resolved(config, config.run.run_dir)  # what `tandem run` and `tandem ray` hand every role
    monkeypatch.chdir(tmp_path)
    assert load_config(written, ["--generator.index", "1"]).env.plugin_paths == expected


def test_a_plugin_beside_the_config_imports_from_any_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_imports: None
) -> None:
    toml = '[env]\nreward_fn = "beside_rewards:exact_match"\nenvironment = ""\n'
    config_path, elsewhere = layout(tmp_path, toml)
    (config_path.parent / "beside_rewards.py").write_text(REWARDS)
    (config_path.parent / "lib").mkdir()
    (config_path.parent / "lib" / "beside_envs.py").write_text(ENVIRONMENT)
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ImportError):
        resolve_reward_fn("beside_rewards:exact_match")  # the working directory alone does not hold it
    config = load_config(config_path, {"env.plugin_paths": ["lib"]})
    assert resolve_reward_fn(config.env.reward_fn, config.env.plugin_paths)("4", {"answer": "4"}) == 1.0
    episode = environment_factory(config.env)()  # the single-turn adapter around the same function
    episode.reset(SimpleNamespace(messages=[{"role": "user", "content": "2+2"}], metadata={"answer": "4"}))
    assert episode.step("4").reward == 1.0
    assert resolve_environment("beside_envs:Echo", config.env.plugin_paths).__name__ == "Echo"  # lib/, relative


def test_a_missing_plugin_says_where_it_was_searched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_imports: None
) -> None:
    config_path, elsewhere = layout(tmp_path)
    monkeypatch.chdir(elsewhere)
    config = load_config(config_path)
    with pytest.raises(ImportError) as error:
        resolve_reward_fn("beside_nothing:score", config.env.plugin_paths)
    message = str(error.value)
    assert f"env.plugin_paths ['{config_path.parent}', '{elsewhere}']" in message, message
    assert "put it beside the config file, name its folder in env.plugin_paths, or install it" in message


def test_the_search_path_goes_first_once(clean_imports: None, tmp_path: Path) -> None:
    from common.plugins import search_first

    folders = [str(tmp_path / "a"), str(tmp_path / "b")]
    sys.path.append(folders[1])
    search_first(folders)
    search_first(folders)
    assert sys.path[:2] == folders and sys.path.count(folders[1]) == 1


def test_a_spec_of_a_module_that_moved_names_its_new_place() -> None:
    with pytest.raises(
        ImportError, match=r"actors.openai_server moved: write 'actors.environments.openai_server:Agent"
    ):
        resolve_callable("actors.openai_server:AgentEnvironment", "env.environment", "module:Class", "a class")
    assert resolve_callable("actors.environments.openai_server:AgentEnvironment", "env.environment", "m:C", "a class")
