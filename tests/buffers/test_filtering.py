"""Dynamic sampling (`buffers.filtering`, buffer.filter = "no_signal"): the no-signal rule and its tolerance, the
exact admission quota, the filtered-share window and its warning, hand-worked; then through the core: groups
filtered at arrival and counted (dropped_no_signal) in the ledger identity, a generator whose every other group is
all-equal still fills every batch with one lease per step, and properties over random runs (the identity after every
message, no served sample staler than η, a restart from the journal restores the state and the window exactly)."""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers.checks import journal_record_problem
from buffers.core import BufferCore
from buffers.filtering import FilterWindow, keep_fraction, no_signal, signal_quota, spread_tolerance
from buffers.journal import Journal
from buffers.staleness import admission_quota
from buffers.state import BufferSettings
from common.config import ConfigError, load_config
from common.types import Batch, BatchRequest, LeaseGrant, LeaseRefused, LeaseRequest, RolloutGroup, VersionReport
from common.wire import decode, encode
from tests.buffers.fakes import (
    GROUP,
    RandomRun,
    advance_learner,
    ask,
    make_core,
    make_group,
    random_ops,
    restarts,
    without_deadlines,
)

EPS32 = 2.0**-23
FILTERED = {"filter": "no_signal"}


def rewards(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


def with_rewards(group: RolloutGroup, values: np.ndarray) -> RolloutGroup:
    return dataclasses.replace(group, rewards=np.asarray(values, np.float32))


# ------------------------------------------------------------------------------------------------ pure functions
def test_no_signal_on_hand_made_rewards() -> None:
    assert no_signal(rewards(1, 1, 1, 1), 0.0)  # all equal: spread 0 <= 0 + 4 ulps
    assert no_signal(rewards(-2, -2), 0.0)
    assert not no_signal(rewards(0, 0, 0, 1), 0.0)  # spread 1 > 0 + 4·2^-23·1
    # spread 0.3 - 0.2 = 0.1 (float32: 0.100000024) against min_reward_spread 0.2 (below) and 0.05 (above)
    assert no_signal(rewards(0.2, 0.3, 0.25), 0.2)
    assert not no_signal(rewards(0.2, 0.3, 0.25), 0.05)
    assert no_signal(rewards(0.0, 0.5), 0.5)  # the comparison is <=: a spread of exactly min_reward_spread drops


def test_the_tolerance_is_four_float32_ulps_of_the_largest_reward() -> None:
    one_ulp = np.nextafter(np.float32(1), np.float32(2))  # 1 + 2^-23
    assert spread_tolerance(rewards(1, one_ulp)) == 4 * EPS32 * (1 + EPS32)
    assert no_signal(rewards(1, one_ulp), 0.0)  # 2^-23 <= 4·2^-23·(1 + 2^-23): equal up to rounding
    five_ulps = np.float32(1 + 5 * EPS32)  # exact in float32
    assert not no_signal(rewards(1, five_ulps), 0.0)  # 5·2^-23 > 4·2^-23·(1 + 5·2^-23) ≈ 4.0000024·2^-23
    assert spread_tolerance(rewards(0, 0)) == 0.0  # rewards of 0 compare exactly


def test_keep_fraction_is_exact_and_capped() -> None:
    assert keep_fraction(0, 0, 0.9) == 1  # no arrivals yet: assume nothing is filtered
    assert keep_fraction(16, 32, 0.9) == Fraction(1, 2)  # 1 - 16/32
    assert keep_fraction(1, 3, 0.9) == Fraction(2, 3)  # 1 - 1/3, exactly
    assert keep_fraction(32, 32, 0.75) == Fraction(1, 4)  # share 1 capped at 0.75 (exact in binary)
    for cap in (0.0, 1.0):
        with pytest.raises(ValueError, match="max_filtered_share"):
            keep_fraction(1, 2, cap)


def test_signal_quota_by_hand() -> None:
    # v = 0, η = 1, B = 2: room = (0 + 1 + 1)·2 - 0 = 4 groups; at keep 1/2 that is 4 / (1/2) = 8 prompts
    assert signal_quota(0, 1, 2, 0, 0, Fraction(1, 2)) == 8
    assert signal_quota(0, 1, 2, 0, 3, Fraction(1, 2)) == 5  # 8 - 3 outstanding
    assert signal_quota(0, 1, 2, 1, 0, Fraction(1, 2)) == 6  # room 3: 3 / (1/2)
    assert signal_quota(0, 1, 2, 0, 0, Fraction(2, 3)) == 6  # 4 / (2/3) = 6 exactly (a float gives 5.999...)
    assert signal_quota(0, 1, 2, 1, 0, Fraction(2, 3)) == 4  # ⌊3 / (2/3)⌋ = ⌊4.5⌋
    assert signal_quota(1, 0, 2, 5, 0, Fraction(1, 2)) == -1  # room (1 + 0 + 1)·2 - 5 = -1: refused
    with pytest.raises(ValueError, match="keep"):
        signal_quota(0, 1, 2, 0, 0, Fraction(0))


@given(
    v=st.integers(0, 20),
    eta=st.integers(0, 4),
    b=st.integers(1, 8),
    admitted=st.integers(0, 200),
    outstanding=st.integers(0, 50),
)
def test_signal_quota_at_keep_1_is_the_unfiltered_quota(v, eta, b, admitted, outstanding) -> None:
    trained_and_buffered = max(0, admitted - outstanding)
    expected = admission_quota(v, eta, b, trained_and_buffered + outstanding)
    assert signal_quota(v, eta, b, trained_and_buffered, outstanding, Fraction(1)) == expected


def test_filter_window_slides_and_warns_once_per_window() -> None:
    window = FilterWindow(4)
    for filtered in (True, False, True, True):
        window.record(filtered)
    assert (window.filtered, window.share) == (3, 0.75)
    window.record(False)  # the first True leaves the window: [F, T, T, F]
    assert (window.filtered, window.share) == (2, 0.5)
    window = FilterWindow(4)
    warned = []
    for _ in range(12):
        window.record(True)
        warned.append(window.warn_due(0.5))
    assert warned == [False, False, False, True] + [False, False, False, True] * 2  # a full window, then every 4
    restored = FilterWindow(4)
    restored.restore(window.snapshot())
    assert (restored.snapshot(), restored.filtered) == (window.snapshot(), 4)


# ------------------------------------------------------------------------------------------------ through the core
def identity_holds(core: BufferCore) -> bool:
    """arrived = trained + dropped_stale + dropped_no_signal + evicted + rejected + buffered, samples and groups."""
    c = core.counters()
    outflows = ("trained", "dropped_stale", "dropped_no_signal", "evicted", "rejected", "buffered")
    return (
        core.state.ledger.gap(core.state.replay.samples, len(core.state.replay)) == (0, 0)
        and c["arrived"] == sum(c[k] for k in outflows)
        and c["arrived_groups"] == sum(c[f"{k}_groups"] for k in outflows)
    )


def test_groups_without_signal_are_dropped_at_arrival_and_counted() -> None:
    core = make_core(**FILTERED, min_reward_spread=0.2)  # B = 2, η = 1
    grant = ask(core, LeaseRequest(0, 3, 0))
    flat, narrow, wide = (make_group(grant.lease_id, p, 0, GROUP) for p in grant.prompts)
    assert ask(core, with_rewards(flat, [1, 1, 1, 1])).status == "accepted"  # acked: its prompt is done
    assert ask(core, with_rewards(narrow, [0.2, 0.3, 0.25, 0.2])).status == "accepted"  # spread 0.1 <= 0.2
    assert ask(core, with_rewards(wide, [0, 1, 0, 1])).status == "accepted"  # spread 1 > 0.2: kept
    c = core.counters()
    assert (c["dropped_no_signal"], c["dropped_no_signal_groups"], c["arrived_groups"]) == (2 * GROUP, 2, 3)
    assert (c["buffered_groups"], c["outstanding"], core.state.dispenser.live) == (1, 0, {})
    assert ask(core, with_rewards(flat, [1, 1, 1, 1])).status == "duplicate"  # its instance was completed
    assert identity_holds(core)
    assert core.metrics()["buffer/dropped_no_signal"] == 2 * GROUP
    assert core.metrics()["buffer/filtered_share"] == pytest.approx(2 / 3)


def test_without_the_filter_all_equal_groups_are_stored() -> None:
    core = make_core()
    grant = ask(core, LeaseRequest(0, 1, 0))
    ask(core, with_rewards(make_group(grant.lease_id, grant.prompts[0], 0, GROUP), [1, 1, 1, 1]))
    assert (core.counters()["dropped_no_signal"], core.counters()["buffered_groups"]) == (0, 1)
    assert "buffer/filtered_share" not in core.metrics()


def test_admission_counts_outstanding_prompts_at_the_share_with_signal() -> None:
    """B = 2, η = 1: (0 + 1 + 1)·2 = 4 groups at v0. 4 prompts leased, prompts 0 and 2 come back all-equal."""
    replies = {}
    for name, config in (("off", {}), ("on", FILTERED)):
        core = make_core(**config)
        grant = ask(core, LeaseRequest(0, 4, 0))
        for i, prompt in enumerate(grant.prompts):
            group = make_group(grant.lease_id, prompt, 0, GROUP)
            ask(core, with_rewards(group, [1] * GROUP) if i % 2 == 0 else group)
        replies[name] = (ask(core, LeaseRequest(0, 8, 0)), ask(core, LeaseRequest(1, 8, 0)))
    # off: all 4 are stored, 4 - 4 admitted = 0: refused "full"
    assert [r.reason for r in replies["off"]] == ["full", "full"]
    # on: 2 buffered, keep = 1 - 2/4 = 1/2: ⌊(4 - 2) / (1/2)⌋ - 0 outstanding = 4 prompts; then 4 - 4 = 0 left
    first, second = replies["on"]
    assert isinstance(first, LeaseGrant) and len(first.prompts) == 4
    assert isinstance(second, LeaseRefused) and second.reason == "full"
    advance_learner(core, 2)
    assert ask(core, LeaseRequest(0, 8, 0)).reason == "stale"  # v0 < V - η = 1: refused with the filter on too


def every_other_group_flat(core: BufferCore, eta: int, steps: int) -> list[int]:
    """A generator (on the learner's weights) leases what admission allows and pushes it in lease order, every
    other group all-equal; each step it repeats until the learner's batch can be drawn. Returns the lease rounds
    each step took (asserting every batch is full and within η)."""
    rounds, arrivals = [], 0
    for step in range(steps):
        for count in range(1, 100):
            reply = ask(core, LeaseRequest(0, 64, step))
            assert isinstance(reply, LeaseGrant), (step, reply)
            for prompt in reply.prompts:
                group = make_group(reply.lease_id, prompt, 0, GROUP, step, seed=arrivals)
                ask(core, with_rewards(group, [1] * GROUP) if arrivals % 2 else group)
                arrivals += 1
            batch = ask(core, BatchRequest(step, 0, 1, 2, 0.0))
            if isinstance(batch, Batch):
                break
        assert len(batch.groups) == 2 and all(lag.max() <= eta for lag in batch.staleness)
        assert all(np.ptp(g.rewards) > 0 for g in batch.groups)  # only groups with signal are trained
        ask(core, VersionReport(step + 1, step + 1))
        rounds.append(count)
        assert identity_holds(core)
    return rounds


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_half_the_groups_filtered_still_fills_every_batch_in_one_lease_round(eta: int) -> None:
    """With half the groups filtered, the learner needs 2B = 4 arrivals per step. Step 0 knows no share yet
    (keep = 1: B·(η + 1) prompts, 2 rounds at η = 0); from then on keep = 1/2 and one lease per step suffices.
    Without the discount, at η = 0 every step would take 2 rounds: B prompts, half of them kept, then B/2 more."""
    core = make_core(prompts=200, max_staleness=eta, capacity=400, **FILTERED)
    rounds = every_other_group_flat(core, eta, steps=12)
    assert rounds[1:] == [1] * 11, rounds
    c = core.counters()
    assert c["trained_groups"] == 24 and c["dropped_stale"] == 0
    assert c["dropped_no_signal_groups"] == c["arrived_groups"] // 2
    assert core.state.filter_window.share == pytest.approx(0.5, abs=1 / 32)


def test_mostly_filtered_warns_once_per_window(caplog: pytest.LogCaptureFixture) -> None:
    core = make_core(prompts=40, max_staleness=8, **FILTERED, filter_window=4, max_filtered_share=0.5)
    caplog.set_level(logging.WARNING, logger="tandem.buffer")
    grant = ask(core, LeaseRequest(0, 11, 0))
    for prompt in grant.prompts:
        ask(core, with_rewards(make_group(grant.lease_id, prompt, 0, GROUP), [0] * GROUP))
    warnings = [r.getMessage() for r in caplog.records if "dynamic sampling" in r.getMessage()]
    assert len(warnings) == 2  # at the 4th and the 8th arrival, not the 11th
    assert "100% of the last 4 groups" in warnings[0] and "too easy or too hard" in warnings[0]


def test_filtered_rewards_lengths_and_truncation_are_summed_carried_and_restored(tmp_path: Path) -> None:
    """Three flat groups filtered, one kept (B = 2, η = 1, max_tokens 8: buckets le_1, le_2, le_4, le_8, gt_8):
        [0.25] x 4, 8 tokens, all truncated          reward sum  1.0
        [-1.5] x 4, 2 tokens, none truncated         reward sum -6.0
        [f32(0.1)] x 4, 8 tokens, 1 truncated        reward sum 4 x 0.100000001490116119384765625 = 0.40000000596...
    no_signal_reward_sum = 1 - 6 + 0.4000000059604644775390625 = -4.5999999940395355224609375 (exact in float64:
    -154350387 x 2^-25). The kept [0, 1, 0, 1] group (8 tokens, 2 truncated) and a later [1, 0, 0, 0] (8, none)
    fill the batch. Generated lengths count the filtered groups too: le_8 = 4 + 4 + 4 + 4 = 16, le_2 = 4; truncated
    4 + 0 + 1 + 2 + 0 = 7 of 20 = 0.35; mean (16 x 8 + 4 x 2) / 20 = 6.8."""
    path, config = tmp_path / "journal.bin", {"max_tokens": 8, **FILTERED}
    core = make_core(journal=Journal(path), **config)
    core.state.restore(0.0)
    grant = ask(core, LeaseRequest(0, 4, 0))
    cases = [
        ([0.25] * 4, 8, ["length"] * 4),
        ([-1.5] * 4, 2, ["stop"] * 4),
        ([0.1] * 4, 8, ["length", "stop", "stop", "stop"]),
        ([0, 1, 0, 1], 8, ["length", "length", "stop", "stop"]),
    ]
    for prompt, (values, tokens, reasons) in zip(grant.prompts, cases):
        group = make_group(grant.lease_id, prompt, 0, GROUP, tokens=tokens)
        assert ask(core, dataclasses.replace(with_rewards(group, values), finish_reasons=reasons)).status == "accepted"
    last = ask(core, LeaseRequest(0, 1, 0))
    ask(core, with_rewards(make_group(last.lease_id, last.prompts[0], 0, GROUP, tokens=8), [1, 0, 0, 0]))
    expected = -4.5999999940395355224609375
    assert expected == -154350387 * 2.0**-25 and core.state.no_signal_reward_sum == expected
    batch = ask(core, BatchRequest(0, 0, 1, 2, 0.0))
    assert (batch.dropped_stale, batch.dropped_no_signal, batch.no_signal_reward_sum) == (0, 12, expected)
    decoded, _ = decode([bytes(f) for f in encode(batch)])  # the learner's view: the same numbers, bit for bit
    assert (decoded.dropped_no_signal, decoded.no_signal_reward_sum) == (12, expected)
    metrics = core.metrics()
    assert metrics["buffer/no_signal_reward_sum"] == expected and metrics["buffer/dropped_no_signal"] == 12
    assert (metrics["buffer/len_generated/le_8"], metrics["buffer/len_generated/le_2"]) == (16, 4)
    assert metrics["buffer/truncated_share_generated"] == 7 / 20
    assert metrics["buffer/len_generated_mean"] == pytest.approx(6.8)  # 136 / 20
    core.state.journal.close()
    for compact in (False, True):  # replayed from the filtered records, then from the compacted counters record
        restarted = make_core(journal=Journal(path), **config)
        restarted.state.restore(1.0)
        assert restarted.state.no_signal_reward_sum == expected
        assert journalled(restarted.metrics()) == journalled(metrics)
        if not compact:
            restarted.state.compact(1.0)
        restarted.state.journal.close()


def journalled(metrics: dict[str, float]) -> dict[str, float]:
    """The buffer's metrics that its journal restores: not this process's traffic (bytes, tokens arrived and sampled:
    buffers.traffic) nor the staleness of its serves."""
    traffic = ("bytes", "staleness_", "tokens_arrived", "tokens_sampled")
    return {k: v for k, v in metrics.items() if not any(word in k for word in traffic)}


def test_a_journal_record_with_a_non_finite_reward_sum_is_refused() -> None:
    meta = {"lease_id": 1, "prompt_id": 2, "samples": 4, "reward_sum": float("nan"), "t": 0.0}
    assert journal_record_problem("filtered", meta)[0] == "bad_number"
    assert journal_record_problem("filtered", {**meta, "reward_sum": -6.0}) is None
    counters = {"counts": {}, "next_seq": 1, "no_signal_reward_sum": float("inf")}
    assert journal_record_problem("counters", counters)[0] == "bad_number"


# ------------------------------------------------------------------------------------------------ properties
class EveryOtherFlat:
    """A core whose every other arriving group (valid or not) has all-equal rewards: RandomRun drives it unchanged."""

    def __init__(self, core: BufferCore) -> None:
        self.core, self.arrivals = core, 0

    def handle(self, message: Any, **kwargs: Any) -> Any:
        if isinstance(message, RolloutGroup):
            self.arrivals += 1
            if self.arrivals % 2:
                message = with_rewards(message, np.full(message.size, 0.5))
        return self.core.handle(message, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.core, name)


OPS = random_ops()


@settings(max_examples=200, deadline=None)
@given(ops=OPS, eta=st.integers(0, 2), reuse=st.integers(1, 2), world_size=st.sampled_from([1, 2]))
def test_ledger_balances_and_eta_holds_with_half_the_groups_filtered(ops, eta, reuse, world_size) -> None:
    """Random leases, out-of-order pushes, resends, bad groups, steps, syncs, expiries and returns with the filter
    on and every other group flat: the identity after every message; `RandomRun.learn` asserts staleness <= η."""
    core = make_core(
        prompts=12, max_staleness=eta, max_reuse=reuse, capacity=8 * GROUP, heartbeat_timeout_s=50.0, **FILTERED
    )
    run = RandomRun(EveryOtherFlat(core), world_size)
    for op, pick in ops:
        run.play(op, pick)
        assert identity_holds(core), core.counters()
        c = core.counters()
        assert c["admitted"] == c["trained_groups"] + c["buffered_groups"] + c["outstanding"]


def fingerprint(core: BufferCore) -> dict[str, Any]:
    state = core.state
    return {
        "counters": core.counters(),
        "buffered": [(e.seq, e.uses, e.group.group_id) for e in state.replay.entries.values()],
        "dispenser": without_deadlines(state.dispenser.snapshot()),
        "live": state.dispenser.live,
        "window": state.filter_window.snapshot(),
        "reward_sum": state.no_signal_reward_sum,  # exactly: float64 sums in the same order
        "versions": (state.learner_version, state.policy_version, state.next_seq),
    }


@settings(max_examples=60, deadline=None)
@given(ops=random_ops(10, 80))
def test_restart_keeps_the_filtered_groups_and_the_window(ops) -> None:
    overrides = {"capacity": 6 * GROUP, "heartbeat_timeout_s": 50.0, "filter_window": 8, **FILTERED}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal.bin"
        core = make_core(prompts=12, journal=Journal(path), **overrides)
        core.state.restore(0.0)
        run = RandomRun(EveryOtherFlat(core))
        for op, pick in ops:
            run.play(op, pick)
        core.state.save_counters()
        before = fingerprint(core)
        core.state.journal.close()
        for restarted in restarts(lambda: make_core(prompts=12, journal=Journal(path), **overrides), run.now):
            assert fingerprint(restarted) == before and identity_holds(restarted)


# ------------------------------------------------------------------------------------------------ config
def test_the_config_keys_reach_the_buffer_settings() -> None:
    config = load_config(None, ["--buffer.filter", "no_signal", "--buffer.min_reward_spread", "0.1"])
    settings_ = BufferSettings.from_config(config)
    assert (settings_.filter, settings_.min_reward_spread, settings_.max_filtered_share) == ("no_signal", 0.1, 0.9)
    assert BufferSettings.from_config(load_config(None)).filter == "none"  # off by default
    with pytest.raises(ConfigError, match="algo.group_size >= 2"):
        load_config(
            None, ["--buffer.filter", "no_signal", "--algo.estimator", "reinforce_pp", "--algo.group_size", "1"]
        )
    with pytest.raises(ConfigError, match="max_filtered_share"):
        load_config(None, ["--buffer.max_filtered_share", "1"])
