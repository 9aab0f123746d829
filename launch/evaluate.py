"""`tandem eval`: offline evaluation of Hugging Face models and Tandem checkpoints with vLLM (docs/evaluation.md).

    tandem eval smollm2                                         # the base model on the three built-in sets, greedy
    tandem eval smollm2 runs/demo --sets arithmetic,arithmetic-d2   # side by side: base vs the run's newest model
    tandem eval runs/demo/checkpoints/step-000030 --samples 4 --temperature 1.0 --out step30.json
    tandem eval runs/ppo/model --reward-model runs/rm/model --config examples/rlhf/ppo.toml

Each MODEL is evaluated in turn: one vLLM engine (the config's model.dtype, `_model_settings`; max_model_len and
generator CPU settings), every set's prompts sampled `--samples` times, the engine shut down before the next model starts. Then
the completions are scored (common.eval_metrics: strict and lenient accuracy, pass@1 / pass@k, reward and its
components, length, truncation), with --reward-model also by a reward model (loaded once, after every engine is
down). It prints one table (rows: set x model) and writes the figures as JSON (`--out`, default ./eval.json).
Everything that can be wrong with the arguments (a model path, a set name, a config key) is reported before the
first engine starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.config import ConfigError, ModelConfig, TandemConfig, load_config
from common.eval_metrics import ScoredCompletion, score_completion, set_metrics
from common.eval_sets import MAX_SET_PROMPTS, SETS, EvalSet, eval_set, parse_set_names
from common.prompt_sources import env_row_mapping

log = logging.getLogger("tandem.launch.evaluate")

DEFAULT_SETS = "arithmetic,arithmetic-d2,arithmetic-reworded"
DEFAULT_REWARD_FN = "common.tasks:arithmetic_reward"
DEFAULT_OUT = "eval.json"
DEFAULT_MAX_TOKENS = 64
SAMPLED_TEMPERATURE = 1.0  # the temperature of --samples K > 1 when --temperature is not given
USAGE_ERROR = 2
STEP_DIR_PREFIX = "step-"


class EvalUsageError(ValueError):
    """An argument `tandem eval` cannot use; the message says what to change (printed as one line, exit 2)."""


# ------------------------------------------------------------------------------------------- models


def _hf_config(path: Path) -> dict[str, Any] | None:
    """The Hugging Face config.json of `path` (a dict with `model_type` or `architectures`), else None: a run
    directory's config.json (the resolved Tandem config) is not one."""
    file = path / "config.json"
    if not file.is_file():
        return None
    data = json.loads(file.read_text())
    return data if isinstance(data, dict) and ("model_type" in data or "architectures" in data) else None


def _newest_checkpoint_hf(checkpoints: Path) -> Path | None:
    from learners.checkpoint import STATE_FILE, STEP_DIR

    steps = sorted(
        (int(m.group(1)), p)
        for p in checkpoints.iterdir()
        if (m := STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file() and _hf_config(p / "hf") is not None
    )
    return steps[-1][1] / "hf" if steps else None


def _policy_dir(path: Path, spec: str) -> Path:
    """The Hugging Face directory that an existing directory `path` names (see `resolve_eval_model`)."""
    if _hf_config(path / "hf") is not None:  # a checkpoint
        if path.name.endswith(".tmp"):
            raise EvalUsageError(f"model {spec!r} is an incomplete checkpoint (the learner died saving it)")
        return path / "hf"
    if _hf_config(path / "model") is not None:  # a run directory with the offline stages' export
        return path / "model"
    if (path / "checkpoints").is_dir():  # a run directory
        newest = _newest_checkpoint_hf(path / "checkpoints")
        if newest is None:
            raise EvalUsageError(f"model {spec!r}: a run directory without model/ and without a complete checkpoint")
        return newest
    if _hf_config(path) is not None:
        return path
    raise EvalUsageError(
        f"model {spec!r} is neither a Hugging Face directory (config.json with model_type), a checkpoint (holding "
        "hf/), nor a run directory (holding model/ or checkpoints/)"
    )


def resolve_eval_model(spec: str) -> Path:
    """The Hugging Face directory a MODEL argument names: `smollm2` / `tiny` (common.model_prep, built on first
    use); a Hugging Face directory; a Tandem checkpoint (`.../checkpoints/step-000030` -> its hf/); a run directory
    (its model/, written by the offline stages, if present, else its newest complete checkpoint's hf/).
    Raises EvalUsageError saying what to pass for anything else, and for a reward model (a sequence classifier:
    evaluate policies, and give reward models as --reward-model)."""
    from common.model_prep import resolve_model_path

    if spec in ("smollm2", "tiny"):
        return resolve_model_path(spec)
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise EvalUsageError(
            f"model {spec!r}: no such directory; give a Hugging Face directory, a checkpoint "
            "(runs/NAME/checkpoints/step-000030), a run directory (runs/NAME), 'smollm2' or 'tiny'"
        )
    model_dir = _policy_dir(path, spec)
    architectures = (_hf_config(model_dir) or {}).get("architectures") or []
    if any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise EvalUsageError(
            f"model {spec!r} ({model_dir}) is a reward model ({architectures[0]}): evaluate a policy, and give a "
            "reward model as --reward-model"
        )
    return model_dir


# --------------------------------------------------------------------------------------- arguments


@dataclass(frozen=True)
class EvalPlan:
    """What `tandem eval` will do, every argument checked."""

    models: dict[str, Path]  # MODEL as written -> its Hugging Face directory
    sets: list[EvalSet]
    config: TandemConfig
    reward_fn_spec: str
    samples: int
    temperature: float
    max_tokens: int
    reward_model: Path | None
    out: Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem eval",
        description="Evaluate Hugging Face models or Tandem checkpoints with vLLM: strict and lenient accuracy, "
        "pass@1 and pass@k, reward, length and truncation per set; a table and a JSON file (docs/evaluation.md).",
    )
    parser.add_argument(
        "models",
        nargs="+",
        metavar="MODEL",
        help="a Hugging Face directory, a checkpoint (runs/NAME/checkpoints/step-000030), a run directory "
        "(its model/, else its newest checkpoint), 'smollm2' or 'tiny'; several: evaluated in turn, side by side",
    )
    parser.add_argument(
        "--sets", default=DEFAULT_SETS, help=f"comma-separated, of {', '.join(SETS)} (default: %(default)s)"
    )
    parser.add_argument(
        "--config",
        help="a run config (TOML or a run's config.json): its model.dtype (default and 'auto': chosen on this "
        "machine, a model saved in float32 kept in float32) and "
        "max_model_len, generator CPU settings, "
        "run.seed, env.reward_fn (default common.tasks:arithmetic_reward) and [reward] dtype/batch_size",
    )
    parser.add_argument("--samples", type=int, default=1, help="completions per prompt, k of pass@k (default 1)")
    parser.add_argument(
        "--temperature",
        type=float,
        help=f"sampling temperature (default: 0, greedy, for --samples 1; {SAMPLED_TEMPERATURE} for more)",
    )
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="completion tokens (default 64)")
    parser.add_argument(
        "--prompts", type=int, default=MAX_SET_PROMPTS, help="prompts per set at most (default %(default)s)"
    )
    parser.add_argument("--reward-model", type=Path, help="also score every completion with this reward model")
    parser.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), help="JSON output (default ./eval.json)")
    return parser


def _sampling(samples: int, temperature: float | None) -> float:
    """The temperature to sample at; EvalUsageError for combinations that cannot be meant."""
    if samples < 1:
        raise EvalUsageError(f"--samples {samples}: must be >= 1")
    if temperature is None:
        return 0.0 if samples == 1 else SAMPLED_TEMPERATURE
    if temperature < 0:
        raise EvalUsageError(f"--temperature {temperature}: must be >= 0 (0 = greedy)")
    if temperature == 0 and samples > 1:
        raise EvalUsageError(f"--samples {samples} with --temperature 0: greedy decoding gives one completion")
    return temperature


def _load_config(spec: str | None) -> TandemConfig:
    if spec is None:
        return load_config(None)
    from launch.cli import resolve_config_path

    return load_config(resolve_config_path(spec))


def plan(argv: list[str]) -> EvalPlan:
    """The checked plan of `tandem eval ARGV`. Raises EvalUsageError or ConfigError saying what to change."""
    args = _parser().parse_args(argv)
    temperature = _sampling(args.samples, args.temperature)
    if args.max_tokens < 1 or args.prompts < 1:
        raise EvalUsageError("--max-tokens and --prompts must be >= 1")
    try:
        names = parse_set_names(args.sets)
    except ValueError as error:
        raise EvalUsageError(f"--sets: {error}") from None
    if len(set(args.models)) != len(args.models):
        raise EvalUsageError(f"a MODEL is named twice in {args.models}")
    config = _load_config(args.config)
    if args.max_tokens >= config.model.max_model_len:
        raise EvalUsageError(
            f"--max-tokens {args.max_tokens}: must be < model.max_model_len = {config.model.max_model_len} "
            "(room for the prompt); lower it, or raise model.max_model_len in --config"
        )
    if args.reward_model is not None and _hf_config(args.reward_model) is None:
        raise EvalUsageError(f"--reward-model {args.reward_model}: not a Hugging Face model directory (no config.json)")
    reward_fn_spec = config.env.reward_fn or DEFAULT_REWARD_FN
    try:
        _reward_fn(config)  # a misnamed function fails now
    except (ValueError, ImportError, AttributeError, TypeError) as error:
        raise EvalUsageError(f"env.reward_fn: {error}") from None
    models = {spec: resolve_eval_model(spec) for spec in args.models}
    try:
        mapping = env_row_mapping(config.env)  # file sets read with the run's keys and template: asked as trained
        sets = [eval_set(name, limit=args.prompts, shots=config.env.shots, mapping=mapping) for name in names]
    except (ValueError, OSError, ImportError) as error:
        raise EvalUsageError(f"--sets: {error}") from None
    return EvalPlan(
        models,
        sets,
        config,
        reward_fn_spec,
        args.samples,
        temperature,
        args.max_tokens,
        args.reward_model,
        args.out,
    )


# ----------------------------------------------------------------------------------------- running


def _model_settings(plan: EvalPlan, model_dir: Path) -> ModelConfig:
    """The [model] settings a model is evaluated with: --config's. An explicit model.dtype there is kept for every
    model; with `auto` (also without --config) a model saved in float32 (config.json's `dtype`, older
    `torch_dtype`) stays float32, and any other is run as `auto` chooses on this machine (common.dtypes: a bfloat16
    model in float32 where bf16 is emulated, which is exact). Casting a model fine-tuned in float32 to bfloat16
    rounds its updates away: an Adam step of lr 2e-5 moves a weight of ~0.05 by ~4e-4 of itself, below bfloat16's
    2^-8 = 4e-3 resolution (measured: an SFT model's held-out strict accuracy 0.875 in float32, 0.020 cast to
    bfloat16)."""
    model = plan.config.model
    if model.dtype != "auto":
        return model
    saved = _hf_config(model_dir) or {}
    dtype = saved.get("dtype") or saved.get("torch_dtype")
    return model.model_copy(update={"dtype": "float32"}) if dtype == "float32" else model


def _generate(plan: EvalPlan, model_dir: Path) -> dict[str, list[list[Any]]]:
    """Every set's completions by one model: set name -> [prompt][sample] Completions. The engine is shut down
    before this returns, whatever happens."""
    from actors.engine.offline_sampling import open_eval_engine, sample_completions

    engine = open_eval_engine(
        model_dir,
        _model_settings(plan, model_dir),
        plan.config.generator,
        temperature=plan.temperature,
        max_tokens=plan.max_tokens,
        seed=plan.config.run.seed,
    )
    try:
        return {s.name: sample_completions(engine, s.records, plan.samples) for s in plan.sets}
    finally:
        engine.shutdown()


def _reward_fn(config: TandemConfig) -> Any:
    """The run's reward function as training scores (env.reward_fn with its args, routed by data_source:
    common.reward_routing), or DEFAULT_REWARD_FN when the config names none."""
    from common.reward_routing import reward_fn_for, reward_routes

    routed = config.env.reward_fn or reward_routes(config.env)
    return reward_fn_for(config.env, override="" if routed else DEFAULT_REWARD_FN)


def _score(plan: EvalPlan, completions: dict[str, list[list[Any]]]) -> dict[str, list[list[ScoredCompletion]]]:
    """Each completion judged and scored by the reward function (see common.eval_metrics.score_completion)."""
    reward_fn = _reward_fn(plan.config)
    scored = {}
    for s in plan.sets:
        scored[s.name] = [
            [score_completion(c, record.metadata, reward_fn) for c in group]
            for record, group in zip(s.records, completions[s.name], strict=True)
        ]
    return scored


def _add_rm_scores(plan: EvalPlan, scored: dict[str, dict[str, list[list[ScoredCompletion]]]]) -> None:
    """`rm_score` of every completion of every model, by `plan.reward_model` (loaded once; the prompt and each
    completion as one chat, scored by the model's single logit, unnormalized), in place."""
    from actors.rewards.model import RewardModelScorer
    from common.chat_format import chat_format

    reward = plan.config.reward
    scorer = RewardModelScorer(
        plan.reward_model,
        reward.dtype,
        reward.batch_size,
        plan.config.model.max_model_len,
        normalize=False,
        chat=chat_format(plan.config.model),
    )
    for by_set in scored.values():
        for s in plan.sets:
            for p, (record, group) in enumerate(zip(s.records, by_set[s.name], strict=True)):
                rm = scorer.score_group(record.messages, [x.completion.text for x in group])
                by_set[s.name][p] = [replace(x, rm_score=float(r)) for x, r in zip(group, rm, strict=True)]


def evaluate(plan: EvalPlan) -> dict[str, Any]:
    """Run the plan; returns the JSON document (see `write_json`)."""
    scored: dict[str, dict[str, list[list[ScoredCompletion]]]] = {}
    seconds: dict[str, float] = {}
    for name, model_dir in plan.models.items():
        started = time.monotonic()
        log.info("evaluating %s (%s) on %s", name, model_dir, ", ".join(s.name for s in plan.sets))
        scored[name] = _score(plan, _generate(plan, model_dir))
        seconds[name] = round(time.monotonic() - started, 1)
    if plan.reward_model is not None:
        _add_rm_scores(plan, scored)
    return {
        "settings": {
            "sets": [s.name for s in plan.sets],
            "samples": plan.samples,
            "temperature": plan.temperature,
            "max_tokens": plan.max_tokens,
            "reward_fn": plan.reward_fn_spec,
            "reward_model": None if plan.reward_model is None else str(plan.reward_model),
            "seed": plan.config.run.seed,
        },
        "models": {
            name: {
                "path": str(plan.models[name]),
                "seconds": seconds[name],
                "sets": {set_name: set_metrics(groups) for set_name, groups in by_set.items()},
            }
            for name, by_set in scored.items()
        },
    }


# ------------------------------------------------------------------------------------------ output


def _cell(value: Any, key: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if key == "mean_tokens" else f"{value:.3f}"
    return str(value)


def _short(name: str, width: int = 24) -> str:
    """A model's name for the table: the argument, its tail kept when long (`…/checkpoints/step-000030`)."""
    return name if len(name) <= width else "…" + name[-(width - 1) :]


# metric key -> its column header (reward components `reward/<name>` are headed by the name)
HEADERS = {
    "strict_accuracy": "strict",
    "lenient_accuracy": "lenient",
    "pass@1": "pass@1",
    "mean_reward": "reward",
    "mean_tokens": "tokens",
    "truncated_share": "trunc",
    "rm_score": "RM",
}


def _columns(result: dict[str, Any]) -> list[str]:
    """The metric keys shown, in order: pass@k only when k > 1 (else it is pass@1), every reward component any
    set has, rm_score with a reward model."""
    every_set = [s for m in result["models"].values() for s in m["sets"].values()]
    components = sorted({key for s in every_set for key in s if key.startswith("reward/")})
    columns = [
        "strict_accuracy",
        "lenient_accuracy",
        "pass@1",
        *(["pass@k"] if result["settings"]["samples"] > 1 else []),
    ]
    columns += ["mean_reward", *components, "mean_tokens", "truncated_share"]
    return columns + (["rm_score"] if any("rm_score" in s for s in every_set) else [])


def render_table(result: dict[str, Any]) -> Any:
    """A rich Table of `result` (as `evaluate` returns it): one row per set and model (models side by side under
    each set), one column per metric; `-` where a metric is not defined for a set."""
    from rich.table import Table

    models, settings = result["models"], result["settings"]
    columns = _columns(result)
    several = len(models) > 1
    about = "" if several else f" of {next(iter(models))}"
    table = Table(
        title=f"tandem eval{about}: {settings['samples']} sample(s) a prompt, temperature {settings['temperature']}"
    )
    table.add_column("set")
    if several:
        table.add_column("model", no_wrap=True, min_width=max(len(_short(name)) for name in models))
    for column in columns:
        header = (
            f"pass@{settings['samples']}" if column == "pass@k" else HEADERS.get(column, column.removeprefix("reward/"))
        )
        table.add_column(header, justify="right")
    table.add_column("prompts", justify="right")
    for set_name in settings["sets"]:
        for i, (model_name, model) in enumerate(models.items()):
            metrics = model["sets"][set_name]
            lead = [set_name if i == 0 else "", *([_short(model_name)] if several else [])]
            table.add_row(*lead, *(_cell(metrics.get(c), c) for c in columns), str(metrics["prompts"]))
        if several:
            table.add_section()
    return table


def write_json(result: dict[str, Any], out: Path) -> None:
    """`result` as indented JSON in `out`, written atomically (a temporary file renamed over it)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out)


def main(argv: list[str]) -> int:
    """`tandem eval ARGV`: 0 when every model was evaluated; 2 (a usage error) with one line saying what to change."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        checked = plan(argv)
    except (EvalUsageError, ConfigError) as error:
        for line in str(error).splitlines():
            print(f"tandem eval: {line}", file=sys.stderr)
        return USAGE_ERROR
    started = time.monotonic()
    result = evaluate(checked)
    from rich.console import Console

    Console(width=max(120, Console().width)).print(render_table(result))
    write_json(result, checked.out)
    print(f"{len(checked.models)} model(s) evaluated in {time.monotonic() - started:.0f} s; figures in {checked.out}")
    return 0
