"""Config of the importance-sampling masks (`algo.is_mask`, `algo.is_mask_low`, `algo.is_mask_high`): they parse
from a file and from overrides, and a bad band or a token mask under GSPO fails at load in one line naming the key.

    .venv/bin/python -m pytest tests/common/test_config_is_mask.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import ConfigError, load_config


def test_defaults_and_keys_parse(tmp_path: Path) -> None:
    algo = load_config(None).algo
    assert (algo.is_mask, algo.is_mask_low, algo.is_mask_high) == ("none", 0.5, 2.0)
    path = tmp_path / "run.toml"
    path.write_text('[algo]\nis_mask = "geometric"\nis_mask_low = 0.999\nis_mask_high = 1.001\n')
    algo = load_config(path).algo
    assert (algo.is_mask, algo.is_mask_low, algo.is_mask_high) == ("geometric", 0.999, 1.001)
    algo = load_config(None, ["--algo.is_mask", "token", "--algo.is_mask_high=5"]).algo
    assert (algo.is_mask, algo.is_mask_high) == ("token", 5.0)
    gspo = {"algo.ratio": "sequence", "algo.aggregation": "seq_mean", "algo.correction": "none"}
    for kind in ("sequence", "geometric"):
        assert load_config(None, {**gspo, "algo.is_mask": kind}).algo.is_mask == kind


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--algo.is_mask_low", "1.0"], "--algo.is_mask_low 1.0: Input should be less than 1"),
        (["--algo.is_mask_low", "0"], "--algo.is_mask_low 0: Input should be greater than 0"),
        (["--algo.is_mask_high", "0.8"], "--algo.is_mask_high 0.8: Input should be greater than 1"),
        (["--algo.is_mask_high", "1"], "--algo.is_mask_high 1: Input should be greater than 1"),
        (["--algo.is_mask", "tokens"], "--algo.is_mask tokens: Input should be 'none', 'token', 'sequence' or"),
    ],
)
def test_a_bad_band_is_refused_naming_the_key(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_a_bad_band_in_a_file_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[algo]\nis_mask_high = 0.9\n")
    with pytest.raises(ConfigError, match=r"algo\.is_mask_high: Input should be greater than 1 \(got 0\.9\)"):
        load_config(path)


def test_a_token_mask_under_gspo_is_refused() -> None:
    gspo = {"algo.ratio": "sequence", "algo.aggregation": "seq_mean", "algo.correction": "none"}
    with pytest.raises(ConfigError, match="algo.is_mask: 'token' drops tokens from inside GSPO's sequence ratio"):
        load_config(None, {**gspo, "algo.is_mask": "token"})
