"""Config: defaults validate, files and overrides compose, every bad key or value fails with one clear line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import ConfigError, TandemConfig, load_config, parse_cores, parse_overrides, write_resolved


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_defaults_validate() -> None:
    config = load_config(None)
    assert isinstance(config, TandemConfig)
    assert config.algo.max_staleness == 2 and config.algo.group_size >= 2


def test_file_and_dotted_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, '[learner]\nlr = 3e-6\n[algo]\nmax_staleness = 4\n[run]\nname = "x"\n')
    config = load_config(path, ["--learner.lr", "1e-6", "--algo.max_staleness=0", "--run.name", "abc"])
    assert config.learner.lr == 1e-6
    assert config.algo.max_staleness == 0
    assert config.run.name == "abc"
    assert config.run.run_dir == Path("runs/abc")


def test_override_values_parse_like_toml() -> None:
    assert parse_overrides(["--a.b", "true", "--a.c", "[1, 2]", "--a.d", "hello", "--a.e=2"]) == {
        "a.b": True,
        "a.c": [1, 2],
        "a.d": "hello",
        "a.e": 2,
    }


@pytest.mark.parametrize(
    ("text", "overrides", "expected"),
    [
        ("[learner]\nlrr = 1\n", [], "learner.lrr: unknown key"),
        ("[learnr]\n", [], "learnr: unknown section; did you mean 'learner'?"),
        ("", ["--learner.lr", "-1"], "--learner.lr -1: Input should be greater than 0"),
        ("", ["--algo.estimator", "dpo"], "--algo.estimator dpo: Input should be 'grpo'"),
        ("", ["--algo.group_size", "1"], "--algo.group_size 1: must be >= 2 for estimator 'grpo'"),
        ("", ["--algo.max_staleness", "-1"], "--algo.max_staleness -1: Input should be greater than or equal to 0"),
        ("", ["--generator.buffer_address", "127.0.0.1:7000"], "generator.buffer_address"),
        ("", ["--learner.sync_every", "5", "--algo.max_staleness", "1"], "--learner.sync_every 5: must be <= "),
        ("", ["--learner.world_size", "3", "--learner.groups_per_step", "4"], "multiple of learner.world_size"),
        ("", ["--env.kind", "file"], "env.source: required when kind = 'file'"),
        ("x = [", [], "not valid TOML"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, text: str, overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, text) if text else None, overrides)  # an empty file is refused as such
    assert expected in str(error.value)


# Combinations the learner cannot train with: refused at load, in one line that names the key to change.
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[algo]\ncorrection = "decoupled"\ntis_level = "sequence"\n', "algo.tis_level: 'sequence' needs correction"),
        ("[algo]\nkl_in_reward = true\n", "algo.kl_in_reward: only with estimator in"),
        ('[algo]\nkl_in_reward = true\nestimator = "rloo"\nkl_coef = 0.1\n', "(got 'rloo')"),
        ('[algo]\nkl_in_reward = true\nestimator = "dr_grpo"\n', "(got 'dr_grpo')"),
        ('[buffer]\nhost = "0.0.0.0"\n', "buffer.host: binding '0.0.0.0' exposes the socket beyond this machine"),
        ('[learner]\nweights_host = "10.0.0.5"\n', "learner.weights_host: binding '10.0.0.5' exposes the socket"),
        ('[weights]\nrelay_host = "10.0.0.7"\n', "weights.relay_host: binding '10.0.0.7' exposes the socket"),
        ('[weights]\ntransport = "carrier-pigeon"\n', "weights.transport"),
        # GSPO takes one weight per sequence and a sequence mean: the default tis/token and token_mean are refused
        ('[algo]\nratio = "sequence"\naggregation = "seq_mean"\n', "algo.ratio: 'sequence' (GSPO) takes one"),
        ('[algo]\nratio = "sequence"\ncorrection = "decoupled"\naggregation = "seq_mean"\n', "tis_level = 'seq"),
        ('[algo]\nratio = "sequence"\ncorrection = "none"\n', "set algo.aggregation = 'seq_mean'"),
        ('[algo]\noverlong = "penalty"\noverlong_window = 129\n', "algo.overlong_window: must be <= the comp"),
        ('[algo]\noverlong = "sometimes"\n', "algo.overlong"),
    ],
)
def test_a_config_the_learner_would_refuse_fails_at_load(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, text))
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_the_combinations_the_learner_trains_with_load() -> None:
    assert load_config(None, ["--algo.correction", "decoupled", "--algo.tis_level", "token"]).algo.correction
    assert load_config(None, ["--algo.correction", "tis", "--algo.tis_level", "sequence"]).algo.tis_level
    for estimator in ("reinforce_pp", "reinforce_pp_baseline", "gae"):
        overrides = ["--algo.estimator", estimator, "--algo.kl_in_reward", "true", "--algo.kl_coef", "0.1"]
        assert load_config(None, overrides).algo.kl_in_reward
    for security in ({"run.insecure": True}, {"run.curve_keys_dir": "/keys"}):
        assert load_config(None, {"buffer.host": "0.0.0.0", "learner.weights_host": "0.0.0.0", **security})
    assert load_config(None, {"buffer.host": "::1"}).buffer.host == "::1"  # loopback: no keys needed
    for correction in ({"algo.correction": "none"}, {"algo.tis_level": "sequence"}):
        assert load_config(None, {"algo.ratio": "sequence", "algo.aggregation": "seq_mean", **correction}).algo.ratio


def test_overlong_budget_and_window() -> None:
    # single-turn: L_max = generator.max_tokens = 128 (the default), window 0 -> 128 // 4 = 32
    config = load_config(None, {"algo.overlong": "penalty"})
    assert (config.overlong_budget, config.overlong_window) == (128, 32)
    config = load_config(None, {"algo.overlong": "penalty", "algo.overlong_window": 128, "generator.max_tokens": 128})
    assert config.overlong_window == 128  # the whole budget is allowed (the ramp starts at 0 tokens)
    assert load_config(None, {"generator.max_tokens": 3}).overlong_window == 1  # 3 // 4 = 0 -> at least 1
    # multi-turn: L_max = env.max_total_tokens (1024 by default), window 1024 // 4 = 256
    config = load_config(None, {"env.environment": "envs.guess:make", "algo.overlong": "penalty"})
    assert (config.overlong_budget, config.overlong_window) == (1024, 256)


def test_missing_file_and_bad_override_syntax(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="--section.key"):
        load_config(None, ["learner.lr", "1"])
    with pytest.raises(ConfigError, match="missing value"):
        load_config(None, ["--learner.lr"])


def test_unknown_key_suggests_the_close_name_or_lists_the_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^buffer.capacityy: unknown key; did you mean 'capacity'\?$"):
        load_config(write(tmp_path, "[buffer]\ncapacityy = 3\n"))
    with pytest.raises(
        ConfigError, match=r"^learner.temperature: unknown key; did you mean 'generator.temperature'\?$"
    ):
        load_config(write(tmp_path, "[learner]\ntemperature = 1.0\n"))
    with pytest.raises(ConfigError, match=r"^buffer.zzz: unknown key \(keys of \[buffer\]: host, port, capacity, "):
        load_config(write(tmp_path, "[buffer]\nzzz = 3\n"))


def test_a_problem_in_an_override_names_the_override_as_written(tmp_path: Path) -> None:
    """Not the file's key: the mistake is on the command line, so the line says which argument to change."""
    file = write(tmp_path, "[learner]\nlr = 1e-6\n")
    for overrides, expected in [
        (["--learner.lrr", "1"], "--learner.lrr 1: unknown key; did you mean --learner.lr?"),
        (["--learner.temperature=1"], "--learner.temperature=1: unknown key; did you mean --generator.temperature?"),
        (["--lerner.lr", "1"], "--lerner.lr 1: unknown section; did you mean --learner.lr?"),
        (["--buffer.capacityy", "3"], "--buffer.capacityy 3: unknown key; did you mean --buffer.capacity?"),
        (["--learner.lr", "-1"], "--learner.lr -1: Input should be greater than 0"),
        (["--run.name", "a b"], "--run.name 'a b': must be letters, digits"),  # quoted as a shell would take it
        (["--learner.lr.x=1"], "--learner.lr.x=1: 'lr' is a value, not a section"),
        (["--generator.max_tokens", "2000"], "--generator.max_tokens 2000: must be < model.max_model_len = 1024"),
    ]:
        with pytest.raises(ConfigError) as error:
            load_config(file, overrides)
        assert str(error.value).startswith(expected), (overrides, str(error.value))
    with pytest.raises(ConfigError, match=r"^learner.lr: Input should be greater than 0 \(got -1.0\)$"):
        load_config(write(tmp_path, "[learner]\nlr = -1.0\n"), ["--learner.total_steps", "3"])  # the file's


def test_every_field_is_documented() -> None:
    for section_name, section in TandemConfig.model_fields.items():
        for name, field in section.annotation.model_fields.items():
            assert field.description, f"{section_name}.{name} has no description"


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    config = load_config(None, ["--learner.lr", "2e-6"])
    path = write_resolved(config, tmp_path / "run")
    assert TandemConfig.model_validate_json(path.read_text()) == config


@pytest.mark.integration
def test_config_module_imports_no_engine() -> None:
    code = (
        "import sys, common.config, common.types, common.wire, common.sockets, common.metrics, common.logs, launch.cli\n"
        "heavy = [m for m in ('torch', 'vllm', 'deepspeed', 'transformers', 'ray') if m in sys.modules]\n"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_resolved_json_loads_with_overrides(tmp_path: Path) -> None:
    path = write_resolved(load_config(None, ["--run.name", "j"]), tmp_path)
    config = load_config(path, ["--generator.index", "3"])
    assert config.run.name == "j" and config.generator.index == 3


def test_parse_cores() -> None:
    assert sorted(parse_cores("0-3,6", "learner.cpu_cores")) == [0, 1, 2, 3, 6]
    assert parse_cores("1", "learner.cpu_cores") == {1} and parse_cores("", "learner.cpu_cores") == set()
    with pytest.raises(ValueError, match="learner.cpu_cores: 'a-b'"):
        parse_cores("a-b", "learner.cpu_cores")
    with pytest.raises(ValueError, match="generator.cpu_cores: '0, 1'"):
        parse_cores("0, 1", "generator.cpu_cores")


def test_core_lists_load_as_integers_arrays_or_strings(tmp_path: Path) -> None:
    """docs/config.md's own examples for generator.cpu_cores (`0`) were refused as "not a valid string"."""
    for written, stored in [("0", "0"), ('"0-3,6"', "0-3,6"), ("[0, 2]", "0,2"), ("[]", "")]:
        from_file = load_config(
            write(tmp_path, f"[generator]\ncpu_cores = {written}\n[learner]\ncpu_cores = {written}")
        )
        assert from_file.generator.cpu_cores == from_file.learner.cpu_cores == stored
        assert load_config(None, ["--generator.cpu_cores", written]).generator.cpu_cores == stored
    assert load_config(None, ["--learner.cpu_cores", "0-3,6"]).learner.cpu_cores == "0-3,6"  # unquoted in a shell
    for bad, expected in [("true", "must be a core list"), ("1.5", "must be a core list"), ("-1", "must look like")]:
        with pytest.raises(ConfigError, match=f"generator.cpu_cores.*{expected}"):
            load_config(write(tmp_path, f"[generator]\ncpu_cores = {bad}\n"))


_DOCUMENTED_EXAMPLE = re.compile(r"e\.g\. ((?:`[^`]+`(?:, | or )?)+)")


def _documented_examples() -> list[tuple[str, str]]:
    """(dotted key, TOML value) of every `e.g. `X`, `Y` or `Z`` in a field's description (docs/config.md)."""
    examples = []
    for section_name, section in TandemConfig.model_fields.items():
        for name, field in section.annotation.model_fields.items():
            for found in _DOCUMENTED_EXAMPLE.finditer(field.description or ""):
                examples += [(f"{section_name}.{name}", value) for value in re.findall(r"`([^`]+)`", found.group(1))]
    return examples


# Values the descriptions name in prose, not after "e.g.": each must load as written.
NAMED_IN_PROSE = [
    ("model.path", '"smollm2"'),
    ("model.path", '"tiny"'),
    ("algo.estimator", '"gae"'),
    ("ray.address", '"auto"'),
    ("ray.address", '"ray://host:10001"'),
    ("ray.address", '"host:6379"'),
    ("weights.transport", '"relay"'),
    ("weights.transport", '"star"'),
]


@pytest.mark.parametrize(("key", "value"), [*_documented_examples(), *NAMED_IN_PROSE], ids=str)
def test_every_documented_example_value_loads(tmp_path: Path, key: str, value: str) -> None:
    section, name = key.split(".")
    load_config(write(tmp_path, f"[{section}]\n{name} = {value}\n"))
    load_config(None, [f"--{key}", value])


def test_the_documented_examples_are_found() -> None:
    assert ("generator.cpu_cores", "0") in _documented_examples()
