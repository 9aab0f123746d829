"""The reward function of a run: one callable that scores each row with its own source's function.

    from common.reward_routing import reward_fn_for
    score = reward_fn_for(config.env)            # every call site: generators, environments, evaluation, tandem eval
    score(completion, record.metadata)           # -> float | dict[str, float], as any reward function

Routes, keyed by the row's `metadata["data_source"]` (veRL's column; a mixed source's `name` for rows without one,
common/prompt_sources.py):
  env.sources[i].reward_fn (+ its reward_fn_args)   for the data_source `name` of that source
  env.reward_fns = {data_source = spec}              for rows of that data_source
  env.reward_fn (+ env.reward_fn_args)              every other row, and rows without a data_source
Without routes the answer is env.reward_fn itself (no wrapper). Every function is resolved here, at start, so a
misnamed one fails before the first sample. A row whose data_source has no route while env.reward_fn is empty
raises KeyError naming it and the keys to set; the generator's reward rule (failure_reward, the failure guard)
treats it as any raising reward function.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.tasks import RewardFn, resolve_reward_fn

DATA_SOURCE = "data_source"


class RoutedReward:
    """Calls the function of the row's data_source (`routes`), else `default`; see the module docstring."""

    def __init__(self, routes: Mapping[str, RewardFn], default: RewardFn | None) -> None:
        self.routes = dict(routes)
        self.default = default

    def __call__(self, completion: str, metadata: Mapping[str, Any]) -> Any:
        source = metadata.get(DATA_SOURCE)
        function = self.routes.get(str(source)) if source is not None else None
        if function is None:
            function = self.default
        if function is None:
            raise KeyError(
                f"no reward function for data_source {source!r} (routed: {sorted(self.routes)}): add it to "
                "env.reward_fns, or set env.reward_fn for every other row"
            )
        return function(completion, metadata)


def reward_routes(env: Any) -> dict[str, tuple[str, dict[str, Any]]]:
    """data_source -> (spec, keyword args) from `[env]` (`common.config.EnvConfig`): env.reward_fns, then each
    source's reward_fn under its name (the config refuses two different functions for one name)."""
    routes = {source: (spec, {}) for source, spec in env.reward_fns.items()}
    for spec in env.sources:
        if spec.reward_fn:
            name = spec.name or Path(spec.source.rstrip("/")).stem
            routes[name] = (spec.reward_fn, dict(spec.reward_fn_args))
    return routes


def reward_fn_for(env: Any, override: str = "") -> RewardFn:
    """The run's reward function (see the module docstring). `override` (e.g. eval.reward_fn) scores every row
    with that one function instead. Raises what `common.tasks.resolve_reward_fn` raises (a misnamed function,
    refused arguments), and ValueError when nothing gives a reward."""
    if override:
        return resolve_reward_fn(override, env.plugin_paths)
    default = resolve_reward_fn(env.reward_fn, env.plugin_paths, env.reward_fn_args) if env.reward_fn else None
    routes = reward_routes(env)
    if not routes:
        if default is None:
            raise ValueError("env.reward_fn: empty, and no env.reward_fns or env.sources[].reward_fn route a row")
        return default
    resolved: dict[tuple[str, str], RewardFn] = {}
    functions = {}
    for source, (spec, args) in routes.items():
        key = (spec, repr(sorted(args.items())))
        if key not in resolved:
            resolved[key] = resolve_reward_fn(spec, env.plugin_paths, args or None)
        functions[source] = resolved[key]
    return RoutedReward(functions, default)


def has_reward_fn(env: Any) -> bool:
    """Whether `[env]` names a reward function to call (env.reward_fn, or a route), or an endpoint (env.reward_url)."""
    return bool(env.reward_fn or env.reward_url or reward_routes(env))
