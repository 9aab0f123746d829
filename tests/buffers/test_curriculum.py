"""The curriculum in the buffer (`buffers.curriculum`, buffer.curriculum = "pass_rate"): pass rates and pools against
hand-made histories, the revisit share and rotation, live prompts left alone, the epochs bound, the histograms and the
no-signal share, a restart (and a compaction) that keeps the rates and the order, switching it on and off across a
restart, and the ledger and η under random runs.

    .venv/bin/python -m pytest tests/buffers/test_curriculum.py -q
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers.core import BufferCore
from buffers.curriculum import CurriculumOrder, PassRates, pass_bucket
from buffers.journal import Journal
from buffers.state import BufferSettings
from common.config import ConfigError, load_config
from common.types import LeaseGrant, LeaseRequest, RolloutGroup
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
from tests.buffers.test_filtering import identity_holds

CURRICULUM = {"curriculum": "pass_rate", "pass_reward": 0.5}  # make_group's rewards are U[0, 1): half pass


def order_over(n: int, rates: dict[int, tuple[int, int]] | None = None, **kwargs: Any) -> CurriculumOrder:
    """An order over prompts 0..n-1 whose last groups were `rates` ({prompt: (passed, samples)})."""
    pass_rates = PassRates()
    for pid, (passed, samples) in (rates or {}).items():
        pass_rates.record(pid, passed, samples)
    return CurriculumOrder(list(range(n)), seed=0, epochs=kwargs.pop("epochs", 0), rates=pass_rates, **kwargs)


def take(order: CurriculumOrder, count: int, live: dict | None = None) -> list[int]:
    """Draw `count` and open them (advance); the prompt ids drawn."""
    chosen, cursor = order.draw(count, set(), live or {})
    order.advance(cursor, {pid: visit for visit, pid in chosen})
    return [pid for _, pid in chosen]


def back(order: CurriculumOrder, pid: int, passed: int, samples: int = 4) -> None:
    order.rates.record(pid, passed, samples)
    order.came_back(pid)


def test_pass_buckets_by_hand() -> None:
    assert [pass_bucket(p, 4) for p in range(5)] == ["none", "under_half", "half_or_more", "half_or_more", "all"]
    assert pass_bucket(0, 0) == "none" and pass_bucket(1, 3) == "under_half"
    rates = PassRates(pass_reward=1.0)
    assert rates.passed(np.array([1.1, 1.0, 0.1, 0.999], np.float32)) == 2  # the format bonus on top still passes
    assert rates.bucket(7) == "unseen" and rates.rate(7) is None
    rates.record(7, 1, 4)
    rates.record(7, 3, 4)  # the most recent group counts, not the history
    assert rates.rate(7) == 0.75 and rates.bucket(7) == "half_or_more"


def test_the_first_pass_serves_every_prompt_once_in_a_fixed_order() -> None:
    first = take(order_over(8), 8)
    assert sorted(first) == list(range(8))
    assert take(order_over(8), 8) == first  # the same seed, the same order
    assert order_over(8).pool(3) == "unseen"


def test_signal_first_least_drawn_first_then_the_other_pools() -> None:
    # 0, 3: signal (2 of 4 pass); 1, 4: easy (all pass); 2, 5: hard (none)
    rates = {0: (2, 4), 1: (4, 4), 2: (0, 4), 3: (2, 4), 4: (4, 4), 5: (0, 4)}
    order = order_over(6, rates, revisit=0.0)
    assert [order.pool(p) for p in range(6)] == ["signal", "easy", "hard", "signal", "easy", "hard"]
    assert sorted(take(order, 2)) == [0, 3]  # with no revisits only signal prompts, while there are free ones
    back(order, 0, 2)
    back(order, 3, 1)  # still signal: 1 of 4
    assert sorted(take(order, 2)) == [0, 3]  # drawn once each: again, in rotation
    # both live now (not came back): the lease still fills, from the easy and hard pools
    assert sorted(take(order, 4, live={(1, 0): 1, (1, 3): 1})) == [1, 2, 4, 5]


@pytest.mark.parametrize("signal_share", [0.0, 0.5, 1.0])
def test_signal_and_new_prompts_share_the_draws(signal_share: float) -> None:
    """Prompts 0-3 had signal, 4-203 were never tried, and every group that comes back has signal: of 100 single
    draws at revisit 0, a share signal_share goes to the signal pool (repeats: prompts drawn or given a rate
    before), in rotation, and the rest to new prompts (0: new prompts first; 1: the signal ones first)."""
    order = order_over(204, {p: (2, 4) for p in range(4)}, revisit=0.0, signal_share=signal_share)
    seen, repeats = set(range(4)), 0
    for _ in range(100):
        (pid,) = take(order, 1)
        repeats += pid in seen
        seen.add(pid)
        back(order, pid, 2)
    if signal_share == 0.0:
        assert repeats == 0  # 100 of the 200 new prompts, none twice
    elif signal_share == 1.0:
        assert repeats == 100 and seen == set(range(4))  # the signal pool is never dry: 0-3 in rotation
    else:
        # each draw is a repeat with probability 1/2: std sqrt(0.25 / 100) = 0.05; 5 std = 0.25
        assert abs(repeats / 100 - 0.5) < 0.25, repeats


def test_a_band_moves_the_pools() -> None:
    order = order_over(3, {0: (1, 4), 1: (3, 4), 2: (4, 4)}, low=0.25, high=0.75)
    assert [order.pool(p) for p in range(3)] == ["hard", "easy", "easy"]  # 0.25 <= low, 0.75 >= high


def test_revisits_take_their_share_and_every_pool_rotates() -> None:
    """2 signal, 4 easy and 4 hard prompts that keep their rates; 2000 draws of one prompt each at revisit 0.2."""
    rates = {0: (1, 4), 1: (3, 4)} | {p: (4, 4) for p in range(2, 6)} | {p: (0, 4) for p in range(6, 10)}
    order = order_over(10, rates, revisit=0.2)
    drawn = []
    for _ in range(2000):
        (pid,) = take(order, 1)
        back(order, pid, *rates[pid])
        drawn.append(pid)
    counts = np.bincount(drawn, minlength=10)
    revisited = counts[2:].sum() / len(drawn)
    # each draw revisits with probability 0.2: the share's std is sqrt(0.2 * 0.8 / 2000) = 0.0089; 5 std = 0.045
    assert abs(revisited - 0.2) < 0.045, revisited
    # least drawn first, within a pool: its members are drawn equally often, to within one
    for pool in ([0, 1], [2, 3, 4, 5], [6, 7, 8, 9]):
        assert counts[pool].max() - counts[pool].min() <= 1, counts
    # and the two revisit pools share the revisits: each half of them, to within 5 std of a binomial(400, 0.5): 50
    assert abs(counts[2:6].sum() - counts[6:].sum()) < 2 * 50, counts


def test_live_and_leased_prompts_are_not_drawn_and_a_lease_never_repeats_a_prompt() -> None:
    order = order_over(4)
    chosen, _ = order.draw(4, {1}, {(0, 2): 7})  # 1 already in this lease (re-issued), 2 live elsewhere
    assert sorted(pid for _, pid in chosen) == [0, 3]
    assert order.draw(10, set(), {})[0].__len__() == 4  # 4 prompts: at most 4 per lease


def test_epochs_bound_the_draws() -> None:
    order = order_over(4, epochs=2)
    assert len(take(order, 3)) == 3 and not order.exhausted
    for pid in range(4):
        back(order, pid, 2)
    assert len(take(order, 10)) == 4  # 3 + 4 = 7 of 8
    assert order.draws == 7 and order.epoch == 1
    for pid in range(4):
        back(order, pid, 2)
    assert len(take(order, 10)) == 1 and order.exhausted and take(order, 1) == []


def test_visits_make_each_instance_key_unique() -> None:
    order = order_over(2)
    keys = []
    for _ in range(3):
        chosen, cursor = order.draw(2, set(), {})
        order.advance(cursor, {pid: visit for visit, pid in chosen})
        keys += chosen
        for _, pid in chosen:
            back(order, pid, 2)
    assert sorted(keys) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]


# ------------------------------------------------------------------------------------------------ through the buffer
def with_rewards(group: RolloutGroup, rewards: list[float]) -> RolloutGroup:
    return dataclasses.replace(group, rewards=np.asarray(rewards, np.float32))


def test_histograms_and_the_no_signal_share_are_counted() -> None:
    core = make_core(prompts=4, pass_reward=1.0)
    grant = ask(core, LeaseRequest(0, 4, 0))
    assert isinstance(grant, LeaseGrant)
    rewards = [[1.0, 1.0, 1.0, 1.0], [0.0, 0.1, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.1, 1.0]]
    for prompt, r in zip(grant.prompts, rewards):
        ask(core, with_rewards(make_group(grant.lease_id, prompt), r))
    values = core.metrics()
    assert values["buffer/pass_leased/unseen"] == 4
    assert [values[f"buffer/pass_generated/{b}"] for b in ("none", "under_half", "half_or_more", "all")] == [1, 1, 1, 1]
    assert values["buffer/no_signal_share_generated"] == 0.5  # all 1.0, all 0.0: equal rewards, no advantage
    advance_learner(core, 2)  # room for 4 more groups at version 2: (2 + η + 1) B = 8
    assert isinstance(ask(core, LeaseRequest(0, 4, 2)), LeaseGrant)  # each prompt in the bucket of its last group
    values = core.metrics()
    assert [values[f"buffer/pass_leased/{b}"] for b in ("unseen", "none", "under_half", "half_or_more", "all")] == [
        4,
        1,
        1,
        1,
        1,
    ]


def fingerprint(core: BufferCore) -> dict[str, Any]:
    state = core.state
    return {
        "counters": core.counters(),
        "dispenser": without_deadlines(state.dispenser.snapshot()),
        "live": state.dispenser.live,
        "rates": state.pass_rates.last,
        "next": state.dispenser.order.draw(3, set(), state.dispenser.live),  # what the next lease would get
    }


@settings(max_examples=60, deadline=None)
@given(ops=random_ops(10, 80))
def test_a_restart_and_a_compaction_keep_the_rates_and_the_order(ops) -> None:
    overrides = {"capacity": 6 * GROUP, "heartbeat_timeout_s": 50.0, **CURRICULUM}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "journal.bin"
        core = make_core(prompts=12, journal=Journal(path), **overrides)
        core.state.restore(0.0)
        run = RandomRun(core)
        for op, pick in ops:
            run.play(op, pick)
        core.state.save_counters()
        before = fingerprint(core)
        core.state.journal.close()
        for restarted in restarts(lambda: make_core(prompts=12, journal=Journal(path), **overrides), run.now):
            assert fingerprint(restarted) == before and identity_holds(restarted)


@settings(max_examples=200, deadline=None)
@given(
    ops=random_ops(),
    eta=st.integers(0, 2),
    reuse=st.integers(1, 2),
    world_size=st.sampled_from([1, 2]),
)
def test_ledger_balances_and_eta_holds_with_the_curriculum(ops, eta, reuse, world_size) -> None:
    """Random leases, out-of-order pushes, resends, bad groups, steps, syncs, expiries and returns with the curriculum
    on: the identity and admission's count after every message; `RandomRun.learn` asserts staleness <= η."""
    core = make_core(
        prompts=12, max_staleness=eta, max_reuse=reuse, capacity=8 * GROUP, heartbeat_timeout_s=50.0, **CURRICULUM
    )
    run = RandomRun(core, world_size)
    for op, pick in ops:
        run.play(op, pick)
        assert identity_holds(core), core.counters()
        c = core.counters()
        assert c["admitted"] == c["trained_groups"] + c["buffered_groups"] + c["outstanding"]
        live = list(core.state.dispenser.live)
        assert len({pid for _, pid in live}) == len(live)  # one live instance per prompt


@pytest.mark.parametrize("first", ["none", "pass_rate"])
def test_switching_the_curriculum_across_a_restart_goes_on_with_unique_keys(tmp_path: Path, first: str) -> None:
    """A run journaled with one order and resumed with the other (buffer.curriculum changed) keeps its leases and
    never makes an instance key it made before, with or without a compaction in between."""
    second = "pass_rate" if first == "none" else "none"
    path = tmp_path / "journal.bin"
    core = make_core(prompts=6, journal=Journal(path), curriculum=first, pass_reward=0.5, heartbeat_timeout_s=50.0)
    core.state.restore(0.0)
    run = RandomRun(core)
    for op, pick in [("lease", 3), ("push", 0), ("lease", 1), ("push", 5), ("push", 2), ("lease", 2)] * 3:
        run.play(op, pick)
    core.state.save_counters()
    made = set(core.state.dispenser.live) | {(p.epoch, p.prompt_id) for _, p, _, _ in run.sent}
    live = dict(core.state.dispenser.live)
    core.state.journal.close()
    for compact in (False, True):
        resumed = make_core(
            prompts=6, journal=Journal(path), curriculum=second, pass_reward=0.5, heartbeat_timeout_s=50.0
        )
        resumed.state.restore(run.now)
        assert resumed.state.dispenser.live == live
        chosen, _ = resumed.state.dispenser.order.draw(6, set(), resumed.state.dispenser.live)
        assert chosen and not set(chosen) & made
        if not compact:
            resumed.state.compact(run.now)
        resumed.state.journal.close()


# ------------------------------------------------------------------------------------------------ config
def test_the_config_keys_reach_the_buffer_settings_and_a_bad_band_is_refused() -> None:
    config = load_config(
        None,
        [
            "--buffer.curriculum",
            "pass_rate",
            "--buffer.curriculum_revisit",
            "0.3",
            "--buffer.curriculum_low",
            "0.1",
            "--buffer.curriculum_pass_reward",
            "0.9",
        ],
    )
    s = BufferSettings.from_config(config)
    assert (s.curriculum, s.curriculum_low, s.curriculum_high, s.curriculum_revisit, s.pass_reward) == (
        "pass_rate",
        0.1,
        1.0,
        0.3,
        0.9,
    )
    with pytest.raises(ConfigError, match="must be below curriculum_high"):
        load_config(None, ["--buffer.curriculum_low", "0.6", "--buffer.curriculum_high", "0.5"])
