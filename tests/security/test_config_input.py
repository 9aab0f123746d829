"""Hostile config input (issue 12, item 9): every malformed config file, value or override is refused at load in
one line that names the key and what to change, with exit code 2 and no traceback; no bad value is accepted.

Each case runs through the real entry point, `launch.cli.main` (what `tandem` and `python -m launch.cli` call), in
this process: `tandem config FILE [overrides]`, or `tandem ROLE FILE` for the paths a role needs on its machine.
A role that would start is replaced by one that fails the test, so a refusal can never be mistaken for a start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import launch.cli
from common.config import ConfigError, TandemConfig, load_config
from common.keys import write_keys
from launch.cli import main
from launch.config_checks import missing_paths

USAGE_ERROR = 2  # what `tandem` exits with on a config error (and argparse on a usage error)
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    """One malformed input. `content`: the config file's text or bytes (None: `where` decides); `where`: "file",
    "dir" (the config path is a directory), "missing" (no such file) or "name" (a bare name, no packaged config of
    it); `expect`: every string the one stderr line must hold (the key path and what to change)."""

    id: str
    content: str | bytes | None
    expect: tuple[str, ...]
    overrides: tuple[str, ...] = ()
    command: str = "config"
    suffix: str = ".toml"
    where: str = "file"
    extra: dict[str, str] = field(default_factory=dict)


def case(id: str, content: str | bytes | None, *expect: str, **kwargs: object) -> Case:
    return Case(id, content, expect, **kwargs)  # type: ignore[arg-type]


NO_FILE_FOR_KEYS = "/nonexistent/tandem-keys"
ONE_KEY = '[run]\nname = "hostile"\n'  # the file beside the override cases: valid, not empty
CASES = [
    # --- TOML syntax
    case("toml-unterminated-string", '[run]\nname = "abc\n', "not valid TOML", "line 2", 'name = "abc'),
    case("toml-duplicate-key", "[learner]\nlr = 1e-6\nlr = 2e-6\n", "not valid TOML", "line 3", "lr = 2e-6"),
    case("toml-duplicate-table", "[learner]\nlr = 1e-6\n[learner]\ntotal_steps = 3\n", "line 3", "[learner]"),
    case("toml-missing-value", "[learner]\nlr =\n", "not valid TOML", "line 2"),
    case("toml-bare-word", "[model]\npath = smollm2\n", "not valid TOML", "line 2", "path = smollm2"),
    # --- wrong types
    case("toml-deep-nesting", "x = " + "[" * 2000 + "]" * 2000 + "\n", "not valid TOML", "nested too deeply"),
    case("string-for-int", '[learner]\ntotal_steps = "100"\n', "learner.total_steps", "without quotes"),
    case("string-not-a-number", '[learner]\nlr = "fast"\n', "learner.lr", "a number"),
    case("bool-for-int", "[learner]\ntotal_steps = true\n", "learner.total_steps", "an integer, not a boolean"),
    case("string-for-bool", '[run]\ninsecure = "yes"\n', "run.insecure", "true or false"),
    case("int-for-bool", "[run]\nsimulate = 1\n", "run.simulate", "true or false"),
    case("fraction-for-int", "[learner]\ntotal_steps = 1.5\n", "learner.total_steps", "integer"),
    case("list-for-table", "learner = [1, 2]\n", "learner", "a table", "[learner]"),
    case("scalar-for-table", "run = 5\n", "run", "a table", "[run]"),
    case("table-for-scalar", "[learner]\nlr = { value = 1 }\n", "learner.lr", "a number"),
    case("list-for-scalar", "[generator]\ntemperature = [1.0]\n", "generator.temperature", "a number"),
    case("nested-env-arg", "[env.environment_args]\nx = { y = 1 }\n", "env.environment_args.x", "a string"),
    # --- unknown sections and keys
    case("bool-for-choice-of-ints", "[learner]\nzero_stage = true\n", "learner.zero_stage", "not a boolean"),
    case("int-for-choice-of-names", "[model]\ndtype = 16\n", "model.dtype", "'bfloat16' or 'float32'"),
    case("unknown-section-typo", "[learnr]\nlr = 1e-6\n", "learnr: unknown section", "did you mean 'learner'"),
    case("unknown-key-typo", "[buffer]\ncapacty = 10\n", "buffer.capacty: unknown key", "did you mean 'capacity'"),
    case("unknown-key-far", "[algo]\nfrobnicate = 1\n", "algo.frobnicate: unknown key", "estimator"),
    case("top-level-key", "seed = 3\n", "seed: unknown section", "did you mean 'run.seed'"),
    # --- numbers that mean nothing
    case("zero-steps", "[learner]\ntotal_steps = 0\n", "learner.total_steps", "greater than or equal to 1"),
    case("negative-capacity", "[buffer]\ncapacity = -5\n", "buffer.capacity", "greater than or equal to 1"),
    case("port-zero", "[buffer]\nport = 0\n", "buffer.port", "greater than or equal to 1"),
    case("port-too-big", "[buffer]\nport = 70000\n", "buffer.port", "less than or equal to 65535"),
    case("temperature-zero", "[generator]\ntemperature = 0\n", "generator.temperature", "greater than 0"),
    case("top-p-zero", "[generator]\ntop_p = 0\n", "generator.top_p", "greater than 0"),
    case("top-p-above-one", "[generator]\ntop_p = 1.5\n", "generator.top_p", "less than or equal to 1"),
    case("negative-eta", "[algo]\nmax_staleness = -1\n", "algo.max_staleness", "greater than or equal to 0"),
    case("group-of-one", "[algo]\ngroup_size = 1\n", "algo.group_size", ">= 2 for estimator 'grpo'"),
    case("zero-lease-timeout", "[buffer]\nlease_timeout_s = 0\n", "buffer.lease_timeout_s", "greater than 0"),
    case(
        "huge-timeout",
        "[buffer]\nheartbeat_timeout_s = 1e300\n",
        "buffer.heartbeat_timeout_s",
        "less than or equal to 604800",
    ),
    case("huge-message-size", "[run]\nmax_message_mb = 1e30\n", "run.max_message_mb", "less than or equal to 1048576"),
    case(
        "huge-prompt-count", "[env]\nnum_prompts = 1000000000000\n", "env.num_prompts", "less than or equal to 1000000"
    ),
    case(
        "huge-sim-sleep", "[generator]\nsim_token_s = 1e300\n", "generator.sim_token_s", "less than or equal to 604800"
    ),
    case("tokens-beyond-context", "[generator]\nmax_tokens = 4096\n", "generator.max_tokens", "model.max_model_len"),
    # --- NaN and infinities (TOML and JSON both accept them)
    case("nan-reward", "[env]\nfallback_reward = nan\n", "env.fallback_reward", "finite"),
    case("inf-temperature", "[generator]\ntemperature = inf\n", "generator.temperature", "finite"),
    case("minus-inf-clip", "[learner]\ngrad_clip = -inf\n", "learner.grad_clip", "finite"),
    case("nan-lr", "[learner]\nlr = nan\n", "learner.lr", "finite"),
    case("nan-env-arg", "[env.environment_args]\nx = nan\n", "env.environment_args.x", "finite"),
    # --- integers beyond 64 bits
    case(
        "index-beyond-2**63",
        "[generator]\nindex = 99999999999999999999\n",
        "generator.index",
        "less than or equal to 2147483647",
    ),
    case("seed-beyond-32-bits", "[run]\nseed = 1099511627776\n", "run.seed", "less than or equal to 2147483647"),
    case(
        "warmup-beyond-2**63",
        "[learner]\nwarmup_steps = 1" + "0" * 25 + "\n",
        "learner.warmup_steps",
        "less than or equal to",
    ),
    case("env-arg-beyond-2**63", "[env.environment_args]\nx = 1" + "0" * 25 + "\n", "env.environment_args.x", "64"),
    # --- strings: empty, malformed, escaping
    case("empty-run-name", '[run]\nname = ""\n', "run.name", "at least 1"),
    case("run-name-escapes-root", '[run]\nname = "../../etc"\n', "run.name", "letters, digits"),
    case("empty-run-root", '[run]\nroot = ""\n', "run.root", "must not be empty", "'.'"),
    case("empty-keys-dir", '[run]\ncurve_keys_dir = ""\n', "run.curve_keys_dir", "must not be empty"),
    case("empty-model-path", '[model]\npath = ""\n', "model.path", "at least 1"),
    case("empty-buffer-host", '[buffer]\nhost = ""\n', "buffer.host", "must not be empty"),
    case("host-with-port", '[buffer]\nhost = "127.0.0.1:5555"\n', "buffer.host", "host name or IP"),
    case("address-no-port", '[generator]\nbuffer_address = "127.0.0.1"\n', "generator.buffer_address", "host:port"),
    case("address-port-zero", '[learner]\nbuffer_address = "127.0.0.1:0"\n', "learner.buffer_address", "1..65535"),
    case(
        "address-port-too-big",
        '[generator]\nweights_address = "127.0.0.1:99999"\n',
        "generator.weights_address",
        "1..65535",
    ),
    case(
        "address-empty-host",
        '[run]\ninsecure = true\n[buffer]\nhost = "0.0.0.0"\n[generator]\nbuffer_address = ":5555"\n',
        "generator.buffer_address",
        "host:port",
    ),
    case("reward-url-not-a-url", '[env]\nreward_url = "not a url"\n', "env.reward_url", "http://"),
    case("cpu-cores-garbage", '[generator]\ncpu_cores = "a-b"\n', "generator.cpu_cores", "'0-3'"),
    # --- paths a role needs on its machine
    case(
        "missing-prompt-file",
        '[env]\nkind = "file"\nsource = "/nonexistent/prompts.jsonl"\n',
        "env.source",
        "does not exist",
        command="buffer",
    ),
    case("missing-model-dir", '[model]\npath = "/nonexistent/model"\n', "model.path", "smollm2", command="generator"),
    case(
        "missing-keys-dir",
        f'[run]\ncurve_keys_dir = "{NO_FILE_FOR_KEYS}"\n',
        "run.curve_keys_dir",
        "tandem keys",
        command="learner",
    ),
    # --- overrides
    case("override-no-dot", ONE_KEY, "--x", "--section.key VALUE", overrides=("--x",)),
    case("override-no-value", ONE_KEY, "--learner.lr: missing value", overrides=("--learner.lr",)),
    case("override-empty-value", ONE_KEY, "learner.lr", "a number", overrides=("--learner.lr=",)),
    case(
        "override-unknown-key",
        ONE_KEY,
        "--learner.lrr 1: unknown key",
        "did you mean --learner.lr?",
        overrides=("--learner.lrr", "1"),
    ),
    case(
        "override-bad-coercion", ONE_KEY, "learner.total_steps", "integer", overrides=("--learner.total_steps", "ten")
    ),
    case(
        "override-names-a-section", ONE_KEY, "--learner", "is a section", "--learner.KEY", overrides=("--learner", "5")
    ),
    case("override-below-a-value", "[learner]\nlr = 1e-6\n", "learner.lr.x", "value", overrides=("--learner.lr.x=1",)),
    case("override-empty-part", ONE_KEY, "--.lr", "empty", overrides=("--.lr", "1")),
    case("override-double-dot", ONE_KEY, "--learner..lr", "empty", overrides=("--learner..lr", "1")),
    case("override-single-dash", ONE_KEY, "-learner.lr", "--section.key", overrides=("-learner.lr", "1")),
    case("override-stray-word", ONE_KEY, "stray", "--section.key", overrides=("stray",)),
    case(
        "override-value-is-next-key",
        ONE_KEY,
        "--run.name: missing value",
        overrides=("--run.name", "--learner.lr", "1e-6"),
    ),
    case("override-deep-nesting", ONE_KEY, "nested too deeply", overrides=("--env.environment_args.x", "[" * 2000)),
    case("override-nan", ONE_KEY, "env.fallback_reward", "finite", overrides=("--env.fallback_reward", "nan")),
    case("override-yes-for-bool", ONE_KEY, "run.insecure", "true or false", overrides=("--run.insecure", "yes")),
    case(
        "override-huge-int",
        ONE_KEY,
        "learner.total_steps",
        "less than or equal to",
        overrides=("--learner.total_steps", "1" + "0" * 30),
    ),
    # --- the config file itself
    case("file-missing", None, "no such config file", "packaged configs by name", where="missing"),
    case("file-is-directory", None, "is a directory", where="dir"),
    case("file-not-utf8", b"[run]\nname = '\xff\xfe'\n", "not UTF-8", "byte 14"),
    case("file-empty", "", "is empty", "demo"),
    case("file-blank", " \n\t\n", "is empty"),
    case("file-too-large", "#" * (16 << 20) + "\n", "larger than 16 MiB"),
    case("name-not-packaged", None, "no such config file", "demo, gpu_cluster", where="name"),
    # --- JSON configs (the resolved run_dir/config.json every role reads)
    case("json-top-level-list", "[1, 2]", "a JSON object", suffix=".json"),
    case("json-top-level-string", '"demo"', "a JSON object", suffix=".json"),
    case("json-list-with-override", "[1]", "a JSON object", suffix=".json", overrides=("--learner.lr", "1")),
    case("json-section-list", '{"learner": [1]}', "learner", "a table", suffix=".json"),
    case("json-syntax", '{"learner": }', "not valid JSON", "line 1", suffix=".json"),
    case("json-nan", '{"learner": {"lr": NaN}}', "learner.lr", "finite", suffix=".json"),
    case("json-huge-float", '{"learner": {"lr": 1e400}}', "learner.lr", "finite", suffix=".json"),
    case("json-duplicate-key", '{"learner": {"lr": 1e-6}, "learner": {}}', "duplicate key 'learner'", suffix=".json"),
    case("json-deep-nesting", '{"env": ' + "[" * 2000 + "]" * 2000 + "}", "nested too deeply", suffix=".json"),
    case("json-empty", "", "is empty", suffix=".json"),
]


def _role_started(config: object) -> int:
    raise AssertionError("the role started: the config should have been refused at load")


def config_argument(tmp_path: Path, item: Case) -> str:
    """The CONFIG argument of `item`, with its file (or directory) written under tmp_path."""
    path = tmp_path / f"bad{item.suffix}"
    if item.where == "missing":
        return str(tmp_path / "missing.toml")
    if item.where == "name":
        return "no-such-packaged-config"
    if item.where == "dir":
        path.mkdir()
    elif isinstance(item.content, bytes):
        path.write_bytes(item.content)
    else:
        path.write_text(item.content or "")
    return str(path)


def test_the_cases_cover_the_brief() -> None:
    assert len(CASES) >= 40 and len({item.id for item in CASES}) == len(CASES)


@pytest.mark.parametrize("item", CASES, ids=[item.id for item in CASES])
def test_malformed_input_is_one_clear_line(
    item: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launch.cli, "ROLES", dict.fromkeys(launch.cli.ROLES, f"{__name__}:_role_started"))
    monkeypatch.chdir(tmp_path)  # no file of a config's name in the working directory shadows the case
    code = main([item.command, config_argument(tmp_path, item), *item.overrides])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == USAGE_ERROR, (code, err)
    assert out == ""
    assert len(lines) == 1, err
    if item.id.startswith("override-"):  # the mistake is on the command line: the line names the override
        assert lines[0].startswith(f"tandem: {item.overrides[0]}"), err
    else:
        assert lines[0].startswith("tandem: config error in "), err
    assert "Traceback" not in err
    for expected in item.expect:
        assert expected in lines[0], f"{expected!r} not in {lines[0]!r}"


def test_several_problems_are_one_line_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "two.toml"
    path.write_text("[learner]\nlr = -1\ntotal_steps = 0\n")
    assert main(["config", str(path)]) == USAGE_ERROR
    lines = capsys.readouterr().err.strip().splitlines()
    assert sorted(line.split(": ")[2] for line in lines) == ["learner.lr", "learner.total_steps"], lines


@pytest.mark.parametrize(
    "path",
    sorted({*(REPO / "launch" / "configs").glob("*.toml"), *(REPO / "examples").rglob("*.toml")}),
    ids=lambda path: path.relative_to(REPO).as_posix(),
)
def test_every_packaged_config_still_loads(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # gpu_cluster's and math_gpu's paths are a GPU machine's (/mnt/shared, /data, /models); examples/rlhf's later
    # stages and examples/distill's run read what an earlier `tandem sft` writes
    other_machine = path.stem in ("gpu_cluster", "math_gpu") or path.parent.name in ("rlhf", "distill")
    elsewhere = ["--no-path-checks"] if other_machine else []
    assert main(["config", str(path), *elsewhere]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["run"]["name"]


@pytest.mark.integration
@pytest.mark.parametrize("item", [c for c in CASES if c.id in ("file-not-utf8", "json-list-with-override")], ids=str)
def test_the_command_line_exits_2_with_one_line(item: Case, tmp_path: Path) -> None:
    """End to end, as a user runs it: the cases that gave a traceback before."""
    argv = [sys.executable, "-m", "launch.cli", "config", config_argument(tmp_path, item), *item.overrides]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert result.returncode == USAGE_ERROR and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr


# --- any input at all: a config is loaded or refused with ConfigError, never anything else
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
KNOWN_KEYS = st.sampled_from(
    [f"{s}.{k}" for s, f in TandemConfig.model_fields.items() for k in f.annotation.model_fields]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sections=st.dictionaries(
        st.sampled_from([*TandemConfig.model_fields, "x"]), st.dictionaries(st.text(max_size=12), VALUES, max_size=4)
    ),
    known=st.dictionaries(KNOWN_KEYS, VALUES, max_size=4),
)
def test_any_nested_value_is_loaded_or_refused_with_config_error(sections: dict, known: dict) -> None:
    try:
        load_config(None, {**{f"{s}.{k}": v for s, table in sections.items() for k, v in table.items()}, **known})
    except ConfigError as error:
        assert str(error).strip() and "Traceback" not in str(error)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=200), args=st.lists(st.text(max_size=20), max_size=4))
def test_any_file_text_and_arguments_are_loaded_or_refused_with_config_error(text: str, args: list[str]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "any.toml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        try:
            load_config(path, args)
        except ConfigError as error:
            assert str(error).strip()


def test_the_paths_a_role_needs_pass_when_present_and_only_roles_check_them(tmp_path: Path) -> None:
    # with its answer: the default reward (arithmetic) raises on a row without one, which `run` refuses (rewards)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": 2}\n')
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    write_keys(tmp_path / "keys")
    present = {"env.kind": "file", "model.path": str(tmp_path / "model"), "run.curve_keys_dir": str(tmp_path / "keys")}
    config = load_config(None, {**present, "env.source": str(tmp_path / "prompts.jsonl")})
    assert all(missing_paths(config, role) == [] for role in ("run", "buffer", "generator", "learner"))
    absent = load_config(None, {**present, "env.source": "/nonexistent.jsonl", "model.path": "/nonexistent"})
    assert (
        len(missing_paths(absent, "run")) == 2 and missing_paths(absent, "config") == missing_paths(absent, "ray") == []
    )
    assert missing_paths(load_config(None, {"model.path": "/nonexistent", "run.simulate": True}), "generator") == []


def test_keys_a_role_cannot_load_are_one_line_at_start(tmp_path: Path) -> None:
    """The key files each role loads are checked before it starts (common.keys.check_keys): an empty folder, a
    secret others may read, the old shared `client` key. One line each, naming run.curve_keys_dir and the fix."""
    keys = tmp_path / "keys"
    keys.mkdir()
    config = load_config(None, {"run.curve_keys_dir": str(keys), "run.simulate": True})
    for role in ("run", "buffer", "generator", "learner"):
        (problem,) = missing_paths(config, role)
        assert problem.startswith("run.curve_keys_dir: ") and "tandem keys" in problem, problem
    keys.rmdir()
    write_keys(keys)
    os.chmod(keys / "generator.key_secret", 0o644)
    assert missing_paths(config, "buffer") == [] and missing_paths(config, "learner") == []
    (problem,) = missing_paths(config, "generator")
    assert f"chmod 600 {keys / 'generator.key_secret'}" in problem
