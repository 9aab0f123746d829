"""The paths (and tracker packages) a role needs on the machine it runs on, checked by `tandem ROLE` before the role
starts.

    problems = missing_paths(config, "buffer")   # [] or ["env.source: '/data/p.jsonl' does not exist on this machine"]

Loading a config checks no path. `tandem config` checks the paths of a `tandem run` on this machine (`run`), unless
told `--no-path-checks` (a config for other machines: a laptop looking at a cluster's); `tandem ray` checks nothing
a node holds. Each role is started as `python -m launch.cli ROLE <run_dir>/config.json` on its own machine, locally
or by Ray, and checks there, so a missing path or a bad first prompt row is one line naming the key at start
rather than a traceback from deep inside the role.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from common.chat_format import chat_format, check_template_text
from common.config import BUILT_IN_MODELS, TandemConfig
from common.eval_sets import check_set_name
from common.keys import SecurityError, check_keys
from common.prompt_sources import check_routes, load_source, source_mappings
from common.reward_routing import has_reward_fn, reward_fn_for
from common.tasks import total_reward

FIRST_ROWS = 100  # rows of a prompt file read before the run: a bad row among them is one line, not a traceback
# The model.path names Tandem builds itself (common.model_prep), as a user needs them explained.
BUILT_IN_MEANING = {
    "smollm2": "'smollm2' (the embedded SmolLM2-135M-Instruct: built into the cache on first use, or ahead by "
    "`tandem prepare-model`)",
    "tiny": "'tiny' (a tiny random model with SmolLM2's tokenizer, for tests; 'tiny:qwen3' and the like: another "
    "architecture, common.tiny_models)",
}
EMBEDDED = " or ".join(BUILT_IN_MEANING.values())

# role -> the checks it needs; `run` starts every role on this machine
NEEDS = {
    "run": ("prompts", "rewards", "eval_sets", "model", "teacher", "chat_template", "reward_model", "keys", "trackers"),
    "buffer": ("prompts", "eval_sets", "keys", "trackers"),
    "generator": ("model", "chat_template", "reward_model", "keys", "trackers"),
    "learner": ("model", "teacher", "keys", "trackers"),
    "sft": ("model", "chat_template", "stage_data", "trackers"),
    "rm": ("model", "chat_template", "stage_data", "trackers"),
    "dpo": ("model", "chat_template", "stage_data", "reference", "trackers"),
    "reward": ("reward_model", "chat_template", "keys", "trackers"),
}
# role -> (the client roles it connects as, whether it serves): which key files it loads (common.keys.check_keys).
# A learner serves the weights on rank 0 only, so its server key is checked when that socket opens.
KEY_USERS = {
    "run": (("generator", "learner"), True),
    "buffer": ((), True),
    "generator": (("generator",), False),
    "learner": (("learner",), False),
    "reward": ((), True),
}


def _relative_hint(path: Path) -> str:
    return "" if path.is_absolute() else f" (a relative path starts at {Path.cwd()})"


def _prompts_problem(config: TandemConfig, role: str) -> str | None:
    """A missing source, or the first bad row among the first FIRST_ROWS of each source (env.source, or every one
    of env.sources; a .jsonl or .parquet file: reading them costs milliseconds; a `datasets` folder is only checked
    to exist, as reading it imports `datasets`), or rows there that no reward function would score."""
    if config.env.kind != "file":
        return None
    sources = source_mappings(config.env)
    keys = [f"env.sources[{i}].source" for i in range(len(sources))] if config.env.sources else ["env.source"]
    first_rows = []
    for key, (written, _, mapping) in zip(keys, sources, strict=True):
        source = Path(written).expanduser()
        if not source.exists():
            return (
                f"{key}: '{written}' does not exist on this machine{_relative_hint(source)}: name a "
                ".jsonl or .parquet file, or a `datasets` folder"
            )
        if source.is_file() and source.suffix not in (".jsonl", ".parquet"):
            return f"{key}: '{written}' must be a .jsonl or .parquet file, or a `datasets` folder"
        if source.is_file():
            try:
                first_rows.append(load_source(str(source), mapping, limit=FIRST_ROWS))
            except (ValueError, ImportError, OSError) as error:  # the message names the file and the line or row
                return f"{key}: {error}"
    if len(first_rows) == len(sources):
        try:
            check_routes(config.env, first_rows)
        except ValueError as error:
            return str(error)
    return None


SCORED_ROWS = 8  # first rows of each source the reward function scores before a run (see _rewards_problem)


def _rewards_problem(config: TandemConfig, role: str) -> str | None:
    """A reward function that raises on every one of the first SCORED_ROWS rows of a source, each scored with the
    row's own label (metadata `answer`, or "") as the completion: a function that cannot score a row whatever the
    model writes (GSM8K's `#### 72` answers under a reward that wants a number) would train the run on
    env.failure_reward, which the generators' guard (actors/rewards/failure_guard.py) stops only after 64 samples. One
    row that scores is enough to pass: a function may raise on a few rows. kind = file only (the embedded tasks
    are scored by their own tests); not an endpoint (env.reward_url: not called before the run); a problem in the
    rows themselves is the prompts check's line."""
    env = config.env
    if env.kind != "file" or env.environment or env.reward_url or not has_reward_fn(env):
        return None
    try:
        score = reward_fn_for(env)
        sources = [(path, load_source(path, mapping, limit=SCORED_ROWS)) for path, _, mapping in source_mappings(env)]
    except (ValueError, ImportError, OSError, TypeError, AttributeError):  # said by the prompts check or at start
        return None
    for path, records in sources:
        errors = []
        for record in records:
            try:
                total_reward(score(str(record.metadata.get("answer", "")), record.metadata))
            except Exception as error:  # noqa: BLE001 - a user reward function may raise anything: that is the finding
                errors.append(f"row {record.prompt_id}: {type(error).__name__}: {error}"[:300])
        if len(errors) == len(records):
            hint = ""
            answer = str(records[0].metadata.get("answer", ""))
            if ("####" in answer or "\\boxed" in answer) and env.reward_fn != "math":
                hint = '; the answers are worked solutions: env.reward_fn = "math" reads them (docs/datasets.md)'
            return (
                f"env.reward_fn: {env.reward_fn or 'the routed reward'!r} raised on each of the first {len(records)} "
                f"rows of {path}, scoring each row's own answer, e.g. {errors[0]}{hint}"
            )
    return None


def _eval_sets_problem(config: TandemConfig, role: str) -> str | None:
    """A `file:` evaluation set that does not exist here (the buffer reads it when evaluation starts)."""
    for i, name in enumerate(config.eval.sets):
        try:
            check_set_name(name)
        except ValueError as error:
            return f"eval.sets[{i}]: {error} on this machine"
    return None


def _model_problem(config: TandemConfig, role: str) -> str | None:
    if config.run.simulate or config.model.path in BUILT_IN_MODELS:  # SIMULATION loads no model
        return None
    path = Path(config.model.path).expanduser()
    if (path / "config.json").is_file():
        return None
    if path.exists():
        return (
            f"model.path: '{config.model.path}' is not a Hugging Face model directory (no config.json in it): "
            f"name the folder that holds config.json, or use {EMBEDDED}"
        )
    close = difflib.get_close_matches(config.model.path, BUILT_IN_MODELS, n=1, cutoff=0.6)
    if close:
        return (
            f"model.path: no such model directory '{config.model.path}' on this machine; did you mean "
            f"{BUILT_IN_MEANING.get(close[0], repr(close[0]))}?"
        )
    return (
        f"model.path: no such model directory '{config.model.path}' on this machine{_relative_hint(path)}: name a "
        f"local Hugging Face model directory, or use {EMBEDDED}"
    )


def _chat_template_problem(config: TandemConfig, role: str) -> str | None:
    """model.chat_template: a template file that is missing, unreadable, or fails to render a probe chat
    (transformers' Jinja renderer: no tokenizer is loaded here; the role checks again with its tokenizer at start)."""
    if config.run.simulate:  # SIMULATION renders no chat
        return None
    try:
        chat = chat_format(config.model)
    except ValueError as error:
        return str(error)
    return check_template_text(chat)


def _reward_model_problem(config: TandemConfig, role: str) -> str | None:
    """env.reward_model must be a model directory where it is loaded: the reward service, a generator that scores
    in-process (reward.in_process), and `tandem run`, which starts either."""
    if not config.env.reward_model or (role == "generator" and not config.reward.in_process):
        return None
    path = Path(config.env.reward_model).expanduser()
    if (path / "config.json").is_file():
        return None
    what = "is not a Hugging Face model directory (no config.json in it)" if path.exists() else "does not exist"
    return (
        f"env.reward_model: '{config.env.reward_model}' {what} on this machine{_relative_hint(path)}: name the "
        "folder `tandem rm` exported (<run_dir>/model) or another sequence-classification model directory"
    )


def _stage_data_problem(config: TandemConfig, role: str) -> str | None:
    """The offline stage's source and eval_source ([sft], [rm] or [dpo]): `arithmetic` (source only), or a .jsonl
    or .parquet file or a `datasets` folder that exists here (its rows are read when the stage starts)."""
    stage = getattr(config, role)
    for key in ("source", "eval_source"):
        value = getattr(stage, key)
        if not value or (key == "source" and value == "arithmetic"):
            continue
        path = Path(value).expanduser()
        if not path.exists():
            also = " or `arithmetic` (the embedded task)" if key == "source" else ""
            return (
                f"{role}.{key}: '{value}' does not exist on this machine{_relative_hint(path)}: name a .jsonl or "
                f".parquet file, or a `datasets` folder{also}"
            )
        if path.is_file() and path.suffix not in (".jsonl", ".parquet"):
            return f"{role}.{key}: '{value}' must be a .jsonl or .parquet file, or a `datasets` folder"
    return None


def _reference_problem(config: TandemConfig, role: str) -> str | None:
    """dpo.reference: empty (model.path is the reference), a built-in model, or a Hugging Face model directory."""
    return _optional_model_problem(
        "dpo.reference", config.dpo.reference, "the SFT model, <run_dir>/model), leave it empty for model.path"
    )


def _teacher_problem(config: TandemConfig, role: str) -> str | None:
    """algo.teacher_model: empty (no distillation), a built-in model, or a Hugging Face model directory."""
    if config.run.simulate:  # SIMULATION loads no model
        return None
    return _optional_model_problem(
        "algo.teacher_model", config.algo.teacher_model, "a `tandem sft` run's <run_dir>/model), leave it empty"
    )


def _optional_model_problem(key: str, value: str, example: str) -> str | None:
    """A model key that may be empty: `example` closes the hint's parenthesis and names what else to do."""
    if not value or value in BUILT_IN_MODELS or value.startswith("tiny:"):
        return None
    path = Path(value).expanduser()
    if (path / "config.json").is_file():
        return None
    what = "is not a Hugging Face model directory (no config.json in it)" if path.exists() else "does not exist"
    return (
        f"{key}: '{value}' {what} on this machine{_relative_hint(path)}: name a model directory ({example}, "
        f"or use {EMBEDDED}"
    )


def _keys_problem(config: TandemConfig, role: str) -> str | None:
    folder = config.run.curve_keys_dir
    if folder is None:
        return None
    if not folder.expanduser().is_dir():
        return (
            f"run.curve_keys_dir: '{folder}' is not a folder on this machine: make the keys with "
            f"`tandem keys {folder}` and give each machine the files its roles need (docs/security.md)"
        )
    clients, serves = KEY_USERS[role]
    try:
        check_keys(folder.expanduser(), clients, serves)
    except SecurityError as error:
        return f"run.curve_keys_dir: {error}"
    return None


def _trackers_problem(config: TandemConfig, role: str) -> str | None:
    missing = [name for name in config.run.trackers if TRACKER_PACKAGES.get(name) and not _installed(name)]
    if not missing:
        return None
    return (
        f"run.trackers: {', '.join(missing)} not installed on this machine: `pip install 'tandem-rl[trackers]'` "
        f"(scripts/setup.sh does), or leave {'them' if len(missing) > 1 else 'it'} out of run.trackers"
    )


def _installed(tracker: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(TRACKER_PACKAGES[tracker]) is not None


TRACKER_PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}  # run.trackers -> the module it imports (tensorboard: core)

CHECKS = {
    "prompts": _prompts_problem,
    "rewards": _rewards_problem,
    "eval_sets": _eval_sets_problem,
    "model": _model_problem,
    "reward_model": _reward_model_problem,
    "chat_template": _chat_template_problem,
    "keys": _keys_problem,
    "stage_data": _stage_data_problem,
    "reference": _reference_problem,
    "teacher": _teacher_problem,
    "trackers": _trackers_problem,
}


def missing_paths(config: TandemConfig, role: str) -> list[str]:
    """One line per path that `role` needs and this machine lacks, each naming its key; [] for a role that needs
    none here (`config`, `ray`)."""
    return [problem for need in NEEDS.get(role, ()) if (problem := CHECKS[need](config, role)) is not None]
