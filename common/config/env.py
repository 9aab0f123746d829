"""`[env]`: the task or environment, its prompts (datasets, mixed sources) and reward functions."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    model_validator,
)

from common.config.base import (
    MAX_ARITHMETIC_PROMPTS,
    MAX_TIMEOUT_S,
    REWARD_FN_PATTERN,
    EnvArg,
    RewardFnArg,
    _check_reward_fn_name,
    _check_url,
    _Section,
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
        "training on env.failure_reward. 1.0 = never stop. The reasons for the numbers: actors/rewards/failure_guard.py.",
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
