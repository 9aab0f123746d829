"""The `tandem` command answers --help at once and reports config errors in one line per problem."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

TANDEM = [sys.executable, "-m", "launch.cli"]
ENGINES = ("torch", "vllm", "deepspeed", "ray", "transformers")
# `tandem ARGS` as `python -m launch.cli` runs it, then the engines it imported, on stderr's last line
HELP_PROBE = f"""
import runpy, sys
sys.argv = ["tandem", *sys.argv[1:]]
try:
    runpy.run_module("launch.cli", run_name="__main__", alter_sys=True)
except SystemExit as exit:
    assert exit.code in (0, None), exit.code
print(sorted({{name.split(".")[0] for name in sys.modules}} & set({ENGINES!r})), file=sys.stderr)
"""


def run_help(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """(`tandem *args` run through HELP_PROBE, seconds it took); the engines it imported are checked to be none."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", HELP_PROBE, *args], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "[]", result.stderr  # no engine imported for --help
    return result, seconds


@pytest.mark.integration
def test_help_is_fast_and_imports_no_engine() -> None:
    # "fast" is what importing no engine buys (checked by run_help, on any machine); the wall-clock bound is only
    # a backstop, loose enough for a loaded 2-core machine (it answers in ~0.3 s; an engine import takes seconds)
    result, seconds = run_help("--help")
    assert seconds < 10.0
    for command in ("demo", "run", "buffer", "generator", "learner", "ray"):
        assert command in result.stdout


@pytest.mark.integration
def test_config_error_exits_2_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[learner]\nlr = -1\n")
    result = subprocess.run([*TANDEM, "config", str(path)], capture_output=True, text=True, check=False)
    assert result.returncode == 2
    assert "learner.lr: Input should be greater than 0 (got -1)" in result.stderr


@pytest.mark.integration
def test_config_prints_resolved_values(tmp_path: Path) -> None:
    path = tmp_path / "ok.toml"
    path.write_text("[algo]\nmax_staleness = 3\n")
    result = subprocess.run(
        [*TANDEM, "config", str(path), "--learner.lr", "5e-7"], capture_output=True, text=True, check=True
    )
    assert '"max_staleness": 3' in result.stdout and '"lr": 5e-7' in result.stdout


def test_config_reference_is_up_to_date() -> None:
    from launch.config_docs import render

    committed = Path(__file__).resolve().parents[2] / "docs" / "config.md"
    assert committed.read_text() == render(), "regenerate: python -m launch.config_docs > docs/config.md"


# --- errors before the run (issue 14, item 9): unit-level through launch.cli.main, one stderr line each, exit 2


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one stderr line of `tandem *argv`, which must exit 2 without printing a config or starting a role."""
    from launch.cli import main

    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_config_catches_a_model_path_that_does_not_exist(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    line = refused(capsys, "config", "demo", "--model.path", "smolm2")
    assert line.startswith("tandem: --model.path smolm2: no such model directory 'smolm2'"), line
    assert "did you mean 'smollm2' (the embedded SmolLM2-135M-Instruct" in line and "tandem prepare-model" in line
    line = refused(capsys, "config", "demo", "--model.path", str(tmp_path))  # a folder, but not a model's
    assert "no config.json in it" in line and "'smollm2'" in line, line
    config = tmp_path / "run.toml"
    config.write_text(f'[model]\npath = "{tmp_path / "qwen"}"\n')
    line = refused(capsys, "config", str(config))  # the file's mistake names the file
    assert line.startswith(f"tandem: config error in {config}: model.path: no such model directory"), line
    assert "--no-path-checks" in line
    from launch.cli import main

    assert main(["config", str(config), "--no-path-checks"]) == 0  # a config for other machines prints
    assert '"path":' in capsys.readouterr().out


def test_config_catches_a_missing_prompt_file_or_its_first_bad_row(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "nope.jsonl"
    line = refused(capsys, "config", "demo", "--env.kind", "file", "--env.source", str(missing))
    assert line.startswith(f"tandem: --env.source {missing}: '{missing}' does not exist on this machine"), line
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1 + 1?", "answer": 2}\n\n{"question": "2 + 2?"}\n')
    line = refused(capsys, "config", "demo", "--env.kind", "file", "--env.source", str(prompts))
    assert f"{prompts}, line 3: no prompt: the row has no 'prompt'" in line and "env.prompt_key" in line, line
    prompts.write_text('{"prompt": "1 + 1?", "answer": 2}\n{"prompt": "fine"}\n')
    from launch.cli import main

    assert main(["config", "demo", "--env.kind", "file", "--env.source", str(prompts)]) == 0


def test_an_unknown_flag_is_refused_with_the_close_one(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert (
        refused(capsys, "prepare-model", "--chek") == "tandem prepare-model: unknown flag --chek; did you mean --check?"
    )
    assert (
        refused(capsys, "keys", str(tmp_path / "k"), "--force")
        == "tandem keys: unknown argument --force (it takes --help)"
    )
    assert not (tmp_path / "k").exists()
    line = refused(capsys, "config", "demo", "--no-path-chekcs")
    assert line == "tandem config: unknown flag --no-path-chekcs; did you mean --no-path-checks?"


def test_a_near_miss_override_names_the_override_and_the_close_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert refused(capsys, "config", "demo", "--learner.lrr", "1e-6") == (
        "tandem: --learner.lrr 1e-6: unknown key; did you mean --learner.lr?"
    )
    assert refused(capsys, "run", "demo", "--lerner.total_steps=3") == (
        "tandem: --lerner.total_steps=3: unknown section; did you mean --learner.total_steps?"
    )
    assert refused(capsys, "config", "demo", "--learner.lr", "-1") == (
        "tandem: --learner.lr -1: Input should be greater than 0"
    )


def test_role_help_shows_the_override_syntax(capsys: pytest.CaptureFixture[str]) -> None:
    from launch.cli import main

    for command in ("run", "buffer", "generator", "learner", "ray", "config", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert "[--section.key VALUE ...]" in out.splitlines()[0], out
        assert "--learner.total_steps 10" in out and "docs/config.md" in out and "tandem config CONFIG" in out
