"""A fleet launched by hand ends with its run: the buffer, two generators and the learner (SIMULATION) started as
separate `tandem ROLE` processes all exit 0 by themselves once the learner reaches learner.total_steps; the
generators were told by the buffer, delivered or returned every prompt they held, and sent nothing after."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.metrics import read_metrics
from launch.testing import RoleUnderTest, run_config, wait_until

pytestmark = pytest.mark.integration  # starts role processes

STEPS = 3


def test_buffer_and_generators_exit_when_the_learner_reaches_total_steps(tmp_path: Path) -> None:
    config = run_config(
        tmp_path,
        "by-hand",
        run={"simulate": True},
        algo={"group_size": 4, "max_staleness": 1},
        env={"num_prompts": 64},
        buffer={"heartbeat_timeout_s": 30.0},  # the wait must not end by the generators' silence
        learner={"total_steps": STEPS, "groups_per_step": 2, "sim_sample_s": 0.01, "sim_weights_mb": 1.0},
        generator={"sim_tokens": 8, "sim_token_s": 0.005, "prompts_in_flight": 4},
    )
    roles = [
        RoleUnderTest(config, "buffer"),
        RoleUnderTest(config, "generator", index=0),
        RoleUnderTest(config, "generator", index=1),
        RoleUnderTest(config, "learner"),
    ]
    try:
        for role in roles:
            role.start()
        # every role exits by itself: none is signalled (a role that fails first is reported with its output)
        wait_until(lambda: all(role.poll() is not None for role in roles), 120, "every role to exit")
        for role in roles:
            assert role.poll() == 0, f"{role.name} exited {role.poll()}:\n{role.tail()}"
    finally:
        for role in roles:
            role.kill()
    logs = config.run.run_dir / "logs"
    assert f"buffer stopped (run over at learner step {STEPS})" in (logs / "buffer-0.log").read_text()
    for index in (0, 1):
        text = (logs / f"generator-{index}.log").read_text()
        assert f"the run is over (the learner reached step {STEPS})" in text, text[-2000:]
        assert "unsent" in text and ", 0 unsent" in text  # the outbox was flushed before it exited
        assert "does not answer" not in text  # it left before the buffer did: no reconnect attempts
    last = read_metrics(config.run.run_dir / "buffer.jsonl")[-1]
    assert last["buffer/leases_active"] == 0  # every lease came back: completed, or returned by its generator
    assert [r["step"] for r in read_metrics(config.run.run_dir / "metrics.jsonl")] == list(range(1, STEPS + 1))
