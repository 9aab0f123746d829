"""What every section shares: limits, `ConfigError`, addresses, the `_Section` base and its field checks, core lists."""

from __future__ import annotations

import ipaddress
import math
import re
import types
import typing
import urllib.parse
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ValidationInfo,
    field_validator,
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
OPENAI_ENDPOINT = (
    "actors.environments.openai_server:AgentEnvironment"  # the built-in environment that binds a port of its own
)
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
