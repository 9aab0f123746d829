"""A run with learner.lora.sync = "adapter" end to end in SIMULATION (`tandem run`: real buffer, publisher, relay and
sockets; the simulation trainer publishes LoRA A/B matrices under the contract's names, the simulation engine takes
them as adapters): every update reaches the generator as an adapter and is loaded, none is refused, and the samples
the learner trains on carry the adapter versions the generator loaded."""

from __future__ import annotations

import pytest

from common.metrics import read_metrics
from launch.testing import RoleUnderTest, run_config

pytestmark = pytest.mark.integration  # starts role processes

STEPS = 4


def test_a_simulated_adapter_run_syncs_every_version_as_an_adapter(tmp_path) -> None:
    config = run_config(
        tmp_path,
        "lora-sim",
        run={"simulate": True},
        algo={"group_size": 4, "max_staleness": 1},
        env={"num_prompts": 64},
        learner={
            "total_steps": STEPS,
            "groups_per_step": 2,
            "sim_sample_s": 0.02,
            "sim_weights_mb": 0.25,
            "lora.rank": 8,
            "lora.sync": "adapter",
        },
        generator={"sim_tokens": 8, "sim_token_s": 0.005, "prompts_in_flight": 4, "drain_timeout_s": 5},
    )
    launcher = RoleUnderTest(config, "run")
    with launcher:
        code = launcher.wait(120)
    output = launcher.output()
    assert code == 0, f"tandem run exited {code}:\n{launcher.tail(8000)}"
    run_dir = config.run.run_dir
    generator_log = "\n".join(p.read_text() for p in run_dir.glob("generator-0*.log")) or output
    assert "rejected_update" not in generator_log and "bad_reply" not in generator_log
    learner = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in learner][-1] == STEPS
    generator = read_metrics(run_dir / "generator-0.jsonl")
    assert max(r["actor/policy_version"] for r in generator) >= STEPS - 1  # adapters loaded, version by version
    assert all(r["actor/weight_fetch_failures"] == 0 for r in generator)
