"""The start-up check that scores a dataset's first rows with the run's reward function (launch/config_checks.py
`_rewards_problem`): `tandem config` refuses a reward that raises on every first row, naming the row and the error,
and passes one that scores any of them. No engine: the reward functions are called in this process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_config
from launch.config_checks import SCORED_ROWS, missing_paths

GSM8K_ROWS = [
    {"question": f"Tom has {i} apples and buys 2 more. How many?", "answer": f"He has {i} + 2 = {i + 2}.\n#### {i + 2}"}
    for i in range(12)
]
MATH_ROWS = [{"problem": "What is half of one?", "solution": "Half of one is $\\boxed{\\frac{1}{2}}$."}] * 3


def _config(tmp_path: Path, rows: list[dict], **env: str) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    lines = [f'{key} = "{value}"' for key, value in env.items()]
    path = tmp_path / "run.toml"
    path.write_text(f'[env]\nkind = "file"\nsource = "{data}"\n' + "\n".join(lines) + "\n")
    return path


def _reward_problems(path: Path) -> list[str]:
    return [p for p in missing_paths(load_config(path, []), "run") if p.startswith("env.reward_fn")]


def test_a_reward_that_cannot_read_the_answers_is_refused_with_the_row_and_the_fix(tmp_path):
    # MATH's LaTeX solutions under the arithmetic reward, which wants a number after '####' or a numeric answer
    path = _config(tmp_path, MATH_ROWS, prompt_key="problem", label_key="solution", reward_fn="arithmetic")
    (problem,) = _reward_problems(path)
    assert problem.startswith("env.reward_fn: 'arithmetic' raised on each of the first 3 rows of ")
    assert "row 0: ValueError: metadata['answer']" in problem
    assert 'env.reward_fn = "math" reads them' in problem


def test_the_math_reward_passes_the_same_rows_and_gsm8k(tmp_path):
    path = _config(tmp_path, MATH_ROWS, prompt_key="problem", label_key="solution", reward_fn="math")
    assert _reward_problems(path) == []
    path = _config(tmp_path, GSM8K_ROWS, prompt_key="question", reward_fn="math")
    assert _reward_problems(path) == []


def test_one_scoring_row_among_the_first_is_enough(tmp_path):
    rows = [{"prompt": "p", "answer": "not a number"}] * (SCORED_ROWS - 1) + [{"prompt": "p", "answer": "3"}]
    assert _reward_problems(_config(tmp_path, rows, reward_fn="arithmetic")) == []
    rows[-1] = {"prompt": "p", "answer": "also not"}
    (problem,) = _reward_problems(_config(tmp_path, rows, reward_fn="arithmetic"))
    assert f"each of the first {SCORED_ROWS} rows" in problem and "hint" not in problem


@pytest.mark.integration  # runs `tandem config` as a process
def test_tandem_config_refuses_it_in_one_line(tmp_path):
    path = _config(tmp_path, MATH_ROWS, prompt_key="problem", label_key="solution", reward_fn="arithmetic")
    result = subprocess.run(
        [sys.executable, "-m", "launch.cli", "config", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "env.reward_fn: 'arithmetic' raised on each of the first 3 rows" in result.stdout + result.stderr
