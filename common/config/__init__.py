"""Typed run configuration: one TOML file, one section per role, dotted overrides.

    cfg = load_config("examples/demo.toml", ["--learner.lr", "1e-6", "--algo.max_staleness=0"])
    cfg.learner.lr  # 1e-06

Each role reads only its own section (plus the few shared ones it names). Importing this module imports no
torch, vllm or deepspeed: entry points parse the config first and import the heavy libraries after.

Failure mode: every problem in a file or an override raises `ConfigError` whose message is one line per problem,
naming the dotted key and what is allowed, e.g. ``learner.lr: must be > 0 (got -1.0)``.

A package, one module per section, so that a section's keys and checks read in one place:
    run, model, env, algo, generator, buffer, learner (with [learner.lora]), weights, reward,
    offline ([sft], [rm], [dpo]), evaluation ([eval]), ray_cluster ([ray]), tracking ([tracking]), slurm ([slurm])
    base      what the sections share: limits, `ConfigError`, addresses, the `_Section` base, field checks, cores
    tandem    `TandemConfig`: every section, and the rules that cross sections (the one place for them)
    parsing   reading: TOML files, `--section.key VALUE` overrides, one-line errors, the resolved copy
Everything is imported from here (`from common.config import load_config, TandemConfig`), never from a module.
"""

from __future__ import annotations

from common.config.algo import AlgoConfig
from common.config.base import (
    BUILT_IN_MODELS,
    GROUP_ESTIMATORS,
    INT64_MAX,
    KL_IN_REWARD_ESTIMATORS,
    MAX_ARITHMETIC_PROMPTS,
    MAX_CONFIG_BYTES,
    MAX_MESSAGE_MB,
    MAX_PORT_OFFSET,
    MAX_SEED_PART,
    MAX_TIMEOUT_S,
    OFFLINE_STAGES,
    OPENAI_ENDPOINT,
    OPENAI_PORT_OFFSET,
    PORT_OFFSETS,
    REWARD_FN_PATTERN,
    Address,
    ConfigError,
    CoreList,
    EnvArg,
    Host,
    RewardFnArg,
    connect_address,
    is_loopback,
    parse_cores,
    reaches,
)
from common.config.buffer import BufferConfig
from common.config.env import EnvConfig, PromptSourceConfig
from common.config.evaluation import MAX_EVAL_PROMPTS, MAX_EVAL_SAMPLES, EvalConfig
from common.config.generator import GeneratorConfig
from common.config.learner import LLAMA_PROJECTIONS, MAX_LORA_RANK, LearnerConfig, LoraConfig
from common.config.model import ModelConfig
from common.config.offline import DpoConfig, RmConfig, SftConfig
from common.config.parsing import (
    apply_overrides,
    build_config,
    chat_template_path,
    load_config,
    override_spellings,
    parse_override_value,
    parse_overrides,
    plugin_search_path,
    read_config_file,
    write_resolved,
)
from common.config.ray_cluster import RayConfig
from common.config.reward import RewardConfig
from common.config.run import RunConfig
from common.config.slurm import SlurmConfig
from common.config.tandem import TandemConfig, batch_split_problems
from common.config.tracking import TRACKERS, TrackingConfig
from common.config.weights import WeightsConfig

__all__ = [
    "BUILT_IN_MODELS",
    "GROUP_ESTIMATORS",
    "INT64_MAX",
    "KL_IN_REWARD_ESTIMATORS",
    "LLAMA_PROJECTIONS",
    "MAX_ARITHMETIC_PROMPTS",
    "MAX_CONFIG_BYTES",
    "MAX_EVAL_PROMPTS",
    "MAX_EVAL_SAMPLES",
    "MAX_LORA_RANK",
    "MAX_MESSAGE_MB",
    "MAX_PORT_OFFSET",
    "MAX_SEED_PART",
    "MAX_TIMEOUT_S",
    "OFFLINE_STAGES",
    "OPENAI_ENDPOINT",
    "OPENAI_PORT_OFFSET",
    "PORT_OFFSETS",
    "REWARD_FN_PATTERN",
    "TRACKERS",
    "Address",
    "AlgoConfig",
    "BufferConfig",
    "ConfigError",
    "CoreList",
    "DpoConfig",
    "EnvArg",
    "EnvConfig",
    "EvalConfig",
    "GeneratorConfig",
    "Host",
    "LearnerConfig",
    "LoraConfig",
    "ModelConfig",
    "PromptSourceConfig",
    "RayConfig",
    "RewardConfig",
    "RewardFnArg",
    "RmConfig",
    "RunConfig",
    "SftConfig",
    "SlurmConfig",
    "TandemConfig",
    "TrackingConfig",
    "WeightsConfig",
    "apply_overrides",
    "batch_split_problems",
    "build_config",
    "chat_template_path",
    "connect_address",
    "is_loopback",
    "load_config",
    "override_spellings",
    "parse_cores",
    "parse_override_value",
    "parse_overrides",
    "plugin_search_path",
    "reaches",
    "read_config_file",
    "write_resolved",
]
