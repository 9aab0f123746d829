"""The generator process end to end with the SIMULATION engine (no vLLM): leases, weights, faults, shutdown.

Each test starts `tandem generator` as a real subprocess against a fake buffer and a fake weight publisher on
loopback ports; the engine is the simulation stand-in, everything else is the production code path.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import pytest

from common.config import TandemConfig
from common.metrics import read_metrics
from common.types import LeaseRefused
from launch.testing import FakeBuffer, FakePublisher, RoleUnderTest, arithmetic_items, run_config

pytestmark = pytest.mark.integration  # starts role processes

GROUP_SIZE = 3
REWARD_FN = "tests.actors.reward_fns:explode_or_length"


def _config(tmp_path: Path, ports: tuple[int, int], base: Path | None = None, **generator: object) -> TandemConfig:
    """The generator's run: `base` (a TOML file that names its reward_fn) or REWARD_FN, on loopback `ports`."""
    return run_config(
        tmp_path / "runs",
        "gen",
        base,
        ports=ports,
        run={"simulate": True},
        algo={"group_size": GROUP_SIZE},
        env={"failure_reward": -1.0, **({} if base else {"reward_fn": REWARD_FN})},
        generator={"sim_tokens": 6, "sim_token_s": 0.002, "prompts_in_flight": 4, "reconnect_max_s": 0.5, **generator},
    )


def _start(config: TandemConfig) -> RoleUnderTest:
    return RoleUnderTest(config, "generator").start()


def _finish(generator: RoleUnderTest, timeout_s: float) -> tuple[int, str]:
    """The exit code and the output; the process group is killed whatever happened."""
    try:
        return generator.wait(timeout_s), generator.output()
    finally:
        generator.kill()


@pytest.fixture
def peers(tmp_path, ports):
    """A buffer leasing 10 prompts two at a time (0, 4 and 8 explode in the reward function) and a publisher."""
    buffer = FakeBuffer(_config(tmp_path, ports), arithmetic_items(10, explode_every=4), lease_size=2)
    with buffer, FakePublisher(ports[1]) as publisher:
        yield buffer, publisher


def _check_group(group, generator_id: int = 0) -> None:
    group.validate()
    assert group.size == GROUP_SIZE and group.generator_id == generator_id
    assert np.all(np.diff(group.offsets) == 6)  # sim_tokens per sample
    for i in range(group.size):
        versions = group.token_versions[group.offsets[i] : group.offsets[i + 1]]
        assert versions.min() == group.versions[i]  # a sample's version is the oldest of its tokens


def test_serves_all_prompts_survives_a_raising_reward_and_exits_when_exhausted(tmp_path, ports, peers, monkeypatch):
    buffer, publisher = peers
    # The reward module sits beside the user's config, and the generator starts in another folder: it imports from
    # the config's folder, recorded in the <run_dir>/config.json it reads (as under `tandem run` and `tandem ray`).
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "beside_config_rewards.py").write_text(f"from {REWARD_FN.replace(':', ' import ')}\n")
    (project / "run.toml").write_text('[env]\nreward_fn = "beside_config_rewards:explode_or_length"\n')
    monkeypatch.chdir(elsewhere)
    process = _start(_config(tmp_path, ports, project / "run.toml"))
    code, err = _finish(process, timeout_s=60)
    assert code == 0, err[-3000:]
    assert "SIMULATION" in err
    groups = buffer.wait_for_groups(10, timeout_s=1)
    for group in groups:
        _check_group(group)
        exploded = group.prompt_id % 4 == 0
        assert (group.rewards == -1.0).all() == exploded
        assert all(r.startswith("env_error: reward: RuntimeError") for r in group.finish_reasons) == exploded
    assert buffer.heartbeats and publisher.requests[0].have_version == 0  # weights asked for before the first lease
    records = read_metrics(tmp_path / "runs" / "gen" / "generator-0.jsonl")
    assert records[-1]["actor/reward_errors"] == 3 * GROUP_SIZE  # prompts 0, 4, 8 raise
    assert records[-1]["actor/groups_delivered"] == 10 and records[-1]["actor/unsent_groups"] == 0
    assert records[-1]["actor/tokens_per_s"] > 0 and 0 <= records[-1]["actor/engine_idle_frac"] <= 1


def test_a_reward_that_fails_on_every_sample_stops_the_generator_with_the_error(tmp_path, ports):
    """GSM8K's `#### 72` answers under a reward that wants a number: every sample fails. The generator exits
    non-zero after MIN_SAMPLES (actors/rewards/failure_guard.py) with the error and a prompt, not training on the fallback."""
    buffer = FakeBuffer(_config(tmp_path, ports), arithmetic_items(40, explode_every=1), lease_size=2)
    with buffer, FakePublisher(ports[1]):
        code, err = _finish(_start(_config(tmp_path, ports)), timeout_s=60)
    assert code != 0, err[-3000:]
    assert "RewardsFailing" in err and "env.stop_failure_share = 0.5" in err, err[-3000:]
    assert "env_error: reward: RuntimeError: reward exploded on purpose" in err, err[-3000:]
    assert len(buffer.groups) * GROUP_SIZE < 40 * GROUP_SIZE  # stopped before the prompts ran out


def test_stale_refusal_loads_newer_weights_and_later_samples_carry_the_version(tmp_path, ports, peers):
    buffer, publisher = peers
    buffer.refusal = lambda request: None if request.policy_version >= 1 else LeaseRefused("stale", 1, 0.1)
    process = _start(_config(tmp_path, ports))
    try:
        # the state under test: refused at v0 and asking again (not 1.5 s that a slow start may not fill)
        process.wait_until(lambda: len(buffer.lease_requests) >= 2, 60, "a second lease request refused at v0")
        assert not buffer.groups and not buffer.leases  # waits for v1, does not lease
        publisher.publish(1, {"w": np.ones(8, np.float32)})
        code, err = _finish(process, timeout_s=60)
    finally:
        process.kill()
    assert code == 0, err[-3000:]
    groups = buffer.wait_for_groups(10, timeout_s=1)
    assert all((g.token_versions == 1).all() and (g.versions == 1).all() for g in groups)
    assert "weights v0 -> v1" in err
    assert len(publisher.requests) < 100  # polled with pauses, not a busy loop
    # the metrics' step (TensorBoard's too) is the policy version sampled with, the learner's step axis; the report
    # number is a metric of its own. A simulated run says so in every record and every log line
    records = read_metrics(tmp_path / "runs" / "gen" / "generator-0.jsonl")
    assert [r["step"] for r in records] == [r["actor/policy_version"] for r in records] and records[-1]["step"] == 1
    assert [r["actor/report"] for r in records] == list(range(len(records)))
    assert all(r["simulation"] is True for r in records)
    stamped = [line for line in err.splitlines() if line[:2].isdigit() and " [generator-0" in line]
    assert stamped and all("[generator-0 SIMULATION]" in line for line in stamped)


def test_buffer_restart_loses_no_group(tmp_path, ports, peers):
    buffer, _ = peers
    process = _start(_config(tmp_path, ports, max_unsent_groups=4, sim_token_s=0.05))  # ~0.3 s a sample
    try:
        buffer.wait_for_groups(2, timeout_s=30)
        buffer.stop()
        before_outage = set(buffer.arrivals)
        # the state the restart needs: the generator has seen the buffer gone (after the link's 3 s request
        # timeout) and fills its outbox; not a fixed 5 s
        process.wait_until(lambda: "does not answer" in process.output(), 60, "the generator to see the buffer gone")
        buffer.start()
        code, err = _finish(process, timeout_s=60)
    finally:
        process.kill()
    assert code == 0, err[-3000:]
    assert sorted(buffer.groups) == sorted((lease, p.prompt_id) for lease, ps in buffer.leases.items() for p in ps)
    assert len(buffer.groups) == 10
    assert set(buffer.arrivals) - before_outage  # groups built while the buffer was gone arrived after its restart
    assert "does not answer" in err and "is back" in err


def test_sigterm_finishes_or_returns_every_leased_prompt(tmp_path, ports, peers):
    buffer, _ = peers
    buffer.when_empty = "full"
    # 400 tokens at 10 ms: a sample needs 4 s, the drain allows 1 s: leased prompts must come back.
    config = _config(tmp_path, ports, sim_tokens=400, sim_token_s=0.01, drain_timeout_s=1.0)
    process = _start(config)
    try:
        deadline = time.monotonic() + 30
        while len(buffer.leases) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        code, err = _finish(process, timeout_s=30)
    finally:
        process.kill()
    assert code == 0, err[-3000:]
    leased = {(lease, p.prompt_id) for lease, prompts in buffer.leases.items() for p in prompts}
    returned = {(r.lease_id, pid) for r in buffer.returns for pid in r.prompt_ids}
    assert returned and returned | set(buffer.groups) == leased
    assert "SIGTERM" in err
