"""Length bias of the staleness bound (`buffers.lengths`, buffer.sampling = "oldest_first" in `buffers.replay`):
the bucket arithmetic by hand; a hand-made arrival sequence in which long groups arrive last with an older version,
dropped under fifo and trained under oldest_first within η; the buffer's metrics report the histograms (read back
from the metrics sink's file) and a restarted buffer restores them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers.accounting import Ledger
from buffers.core import BufferCore
from buffers.journal import Journal
from buffers.lengths import LengthCounts, bucket_counts, bucket_names, length_edges, length_metrics, sample_lengths
from buffers.replay import choose_positions, draw_order_key
from common.metrics import MetricsSink, read_metrics
from common.types import Batch, BatchNotReady, BatchRequest, LeaseGrant, LeaseRequest, VersionReport
from tests.buffers.fakes import GROUP, RandomRun, ask, make_core, make_group, random_ops

SHORT, LONG = 4, 64  # completion tokens of a short and of a long sample; max_tokens 64: edges 2, 4, ..., 64


def test_edges_halve_max_tokens_and_buckets_are_right_closed() -> None:
    assert length_edges(64) == [2, 4, 8, 16, 32, 64]  # ⌈64 / 2^k⌉, k = 5 .. 0
    assert length_edges(5) == [1, 2, 3, 5]  # ⌈5/32⌉ = ⌈5/16⌉ = ⌈5/8⌉ = 1, ⌈5/4⌉ = 2, ⌈5/2⌉ = 3, 5
    assert bucket_names([2, 4]) == ["le_2", "le_4", "gt_4"]
    # 0 and 2 in (.., 2]; 3 in (2, 4]; 64 in (32, 64]; 65 above 64
    assert bucket_counts(np.array([0, 2, 3, 64, 65]), length_edges(64)).tolist() == [2, 1, 0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="max_tokens"):
        length_edges(0)


def test_a_sample_is_as_long_as_its_model_tokens() -> None:
    group = make_group(1, (0, 0), size=3, tokens=1)
    # three samples of 3, 0 and 4 tokens; the loss mask keeps 2, 0 and 2 of them (environment tokens are 0)
    mask = np.array([1, 0, 1, 1, 1, 0, 0], np.uint8)
    group = dataclasses.replace(
        group,
        offsets=np.array([0, 3, 3, 7], np.int64),
        completion_tokens=np.zeros(7, np.int32),
        behaviour_logprobs=np.zeros(7, np.float32),
        loss_mask=mask,
        token_versions=np.zeros(7, np.int32),
    )
    assert sample_lengths(group).tolist() == [2, 0, 2]


def test_the_truncated_share_counts_finish_reason_length_per_kind() -> None:
    """Generated: 4 short samples, 1 truncated; 4 long, 3 truncated (one "error: ..." is not truncated): 4 / 8.
    Trained: only the short group, 1 / 4. A group's `tally` is what `count` adds for it."""
    ledger = Ledger()
    lengths = LengthCounts(ledger, max_tokens=8)  # edges 1, 2, 4, 8
    short = dataclasses.replace(make_group(1, (0, 0), tokens=2), finish_reasons=["length", "stop", "stop", "stop"])
    long_ = dataclasses.replace(
        make_group(1, (1, 0), tokens=8), finish_reasons=["length", "length", "error: engine", "length"]
    )
    assert lengths.tally(long_) == {"le_8": 4, "tokens": 32, "truncated": 3}  # 4 samples x 8 tokens
    lengths.count("generated", [short, long_])
    lengths.count("trained", [short])
    values = length_metrics(ledger.counts, lengths.edges)
    assert values["buffer/truncated_share_generated"] == 0.5  # (1 + 3) / 8
    assert values["buffer/truncated_share_trained"] == 0.25  # 1 / 4
    assert "buffer/truncated_share_dropped_stale" not in values  # no sample dropped: no share
    assert ledger.counts["len_trained/truncated"] == 1 and "len_trained/le_8" not in ledger.counts


def test_length_metrics_fill_every_bucket_and_give_means_and_drop_rates() -> None:
    ledger = Ledger()
    lengths = LengthCounts(ledger, max_tokens=8)  # edges 1, 2, 4, 8 (⌈8/32⌉ = ⌈8/16⌉ = ⌈8/8⌉ = 1)
    short, long_ = make_group(1, (0, 0), tokens=2), make_group(1, (1, 0), tokens=8)
    lengths.count("generated", [short, long_])
    lengths.count("dropped_stale", [long_])
    lengths.count("trained", [short])
    values = length_metrics(ledger.counts, lengths.edges)
    assert values["buffer/len_generated/le_2"] == 4 and values["buffer/len_generated/le_8"] == 4
    assert values["buffer/len_generated/le_1"] == 0 and values["buffer/len_trained/gt_8"] == 0
    assert values["buffer/len_generated_mean"] == 5.0  # (4 x 2 + 4 x 8) / 8 samples
    assert values["buffer/len_trained_mean"] == 2.0 and values["buffer/len_dropped_stale_mean"] == 8.0
    assert values["buffer/len_drop_rate_shortest"] == 0.0  # le_2: 0 of 4 dropped
    assert values["buffer/len_drop_rate_longest"] == 1.0  # le_8: 4 of 4 dropped
    with pytest.raises(KeyError, match="length kind"):
        lengths.count("evicted", [short])


def test_oldest_first_takes_the_smallest_keys_and_needs_them() -> None:
    rng = np.random.default_rng(0)
    keys = [(1, 2, 0), (0, 5, 3), (1, 1, 9), (0, 5, 1)]  # (version, lease, prompt)
    assert choose_positions(4, 3, "oldest_first", rng, keys) == [3, 1, 2]
    assert choose_positions(4, 5, "oldest_first", rng, keys) is None
    with pytest.raises(ValueError, match="one key per buffered group"):
        choose_positions(4, 2, "oldest_first", rng)
    assert draw_order_key(make_group(7, (3, 0), version=[2, 1, 4, 1])) == (1, 7, 3)


def _late_long_groups(core: BufferCore) -> tuple[list[list[tuple[int, int]]], list[tuple[int, int]]]:
    """B = 2, η = 1. At v0 a generator leases 4 prompts: two long (64 tokens), two short (4). The short ones arrive
    and step 0 trains them. At v1 it leases 2 more, short; they arrive, and only then the two long v0 groups. Step 1
    is the last step a v0 group may be trained at (1 - 0 <= η). Returns the (lease, prompt) ids trained at steps 0, 1
    and 2, and those of the long groups."""
    first = ask(core, LeaseRequest(0, 4, 0))
    assert isinstance(first, LeaseGrant) and len(first.prompts) == 4  # (0 + 1 + 1) x 2 groups
    long_prompts, short_prompts = first.prompts[:2], first.prompts[2:]
    for prompt in short_prompts:
        ask(core, make_group(first.lease_id, prompt, size=GROUP, version=0, tokens=SHORT))
    steps = [_step(core, 0)]
    second = ask(core, LeaseRequest(0, 2, 1))
    assert isinstance(second, LeaseGrant) and len(second.prompts) == 2  # (1 + 1 + 1) x 2 - 4 admitted
    for prompt in second.prompts:
        ask(core, make_group(second.lease_id, prompt, size=GROUP, version=1, tokens=SHORT))
    for prompt in long_prompts:
        ask(core, make_group(first.lease_id, prompt, size=GROUP, version=0, tokens=LONG))
    steps += [_step(core, 1), _step(core, 2)]
    return steps, [(first.lease_id, prompt.prompt_id) for prompt in long_prompts]


def _step(core: BufferCore, step: int) -> list[tuple[int, int]]:
    """The groups the learner trains at `step` (none if no batch), checking η; reports step + 1 after a batch."""
    reply = ask(core, BatchRequest(step, 0, 1, 2, 0.0))
    if isinstance(reply, BatchNotReady):
        return []
    assert isinstance(reply, Batch)
    assert all(int(lag.max()) <= core.settings.max_staleness for lag in reply.staleness)
    ask(core, VersionReport(step + 1, step + 1))
    return [group.group_id for group in reply.groups]


def _core(sampling: str, journal: Journal | None = None) -> BufferCore:
    return make_core(
        prompts=12, journal=journal, sampling=sampling, max_staleness=1, max_tokens=LONG, max_model_len=128
    )


def test_fifo_drops_the_late_long_groups_and_oldest_first_trains_them() -> None:
    results = {}
    for sampling in ("fifo", "oldest_first"):
        core = _core(sampling)
        results[sampling] = (*_late_long_groups(core), core.counters(), core.metrics())
        assert core.state.ledger.gap(core.state.replay.samples, len(core.state.replay)) == (0, 0)
    fifo_steps, long_ids, fifo_counts, fifo = results["fifo"]
    oldest_steps, same_long_ids, oldest_counts, oldest = results["oldest_first"]
    assert long_ids == same_long_ids and all(lease == 1 for lease, _ in long_ids)  # the dispenser's order is seeded
    # fifo: step 1 takes the v1 groups that arrived first (lease 2); step 2 drops the long v0 ones (2 - 0 > η)
    assert [lease for lease, _ in fifo_steps[1]] == [2, 2] and fifo_steps[2] == []
    assert fifo_counts["dropped_stale_groups"] == 2 and fifo_counts["trained_groups"] == 4
    # oldest_first: the long v0 groups at step 1 (their last step within η), the v1 groups at step 2 (1 - 1 <= η)
    assert sorted(oldest_steps[1]) == sorted(long_ids) and [lease for lease, _ in oldest_steps[2]] == [2, 2]
    assert oldest_counts["dropped_stale"] == 0 and oldest_counts["trained_groups"] == 6
    # 4 groups x 4 samples of 4 tokens, 2 x 4 of 64: generated (16 x 4 + 8 x 64) / 24 = 24 tokens on average
    for values in (fifo, oldest):
        assert values["buffer/len_generated/le_4"] == 16 and values["buffer/len_generated/le_64"] == 8
        assert values["buffer/len_generated_mean"] == 24.0
    assert fifo["buffer/len_trained/le_64"] == 0 and fifo["buffer/len_dropped_stale/le_64"] == 8
    assert fifo["buffer/len_trained_mean"] == 4.0  # only short ones trained
    assert fifo["buffer/len_drop_rate_longest"] == 1.0 and fifo["buffer/len_drop_rate_shortest"] == 0.0
    assert oldest["buffer/len_trained/le_64"] == 8 and oldest["buffer/len_trained_mean"] == 24.0
    assert oldest["buffer/len_drop_rate_longest"] == 0.0 and "buffer/len_dropped_stale_mean" not in oldest


def test_the_histograms_reach_the_metrics_file_and_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "journal.bin"
    core = _core("fifo", Journal(path))
    core.state.restore(0.0)  # opens the journal for appending
    _late_long_groups(core)
    sink = MetricsSink(tmp_path, "buffer", tensorboard=False)
    sink.log(core.state.learner_version, core.metrics())  # as buffers.service writes buffer.jsonl
    sink.close()
    record = read_metrics(tmp_path / "buffer.jsonl")[-1]
    assert record["buffer/len_dropped_stale/le_64"] == 8 and record["buffer/len_trained/le_4"] == 16
    assert record["buffer/len_generated_mean"] == 24.0 and record["buffer/len_drop_rate_longest"] == 1.0
    assert {f"buffer/len_generated/{name}" for name in bucket_names(length_edges(LONG))} <= record.keys()
    core.state.journal.close()
    again = _core("fifo", Journal(path))
    again.state.restore(1.0)
    assert again.counters() == core.counters()


@settings(max_examples=150, deadline=None)
@given(
    ops=random_ops(),
    eta=st.integers(0, 2),
    reuse=st.integers(1, 2),
    world_size=st.sampled_from([1, 2]),
)
def test_oldest_first_keeps_eta_and_the_ledger_over_random_runs(ops, eta, reuse, world_size) -> None:
    """`RandomRun.learn` asserts that no served sample exceeds η; the books balance after every message, and the
    length counts agree with the flows (every generated, trained or dropped sample is counted in one bucket)."""
    core = make_core(prompts=12, max_staleness=eta, max_reuse=reuse, sampling="oldest_first", capacity=6 * GROUP)
    run = RandomRun(core, world_size)
    for op, pick in ops:
        run.play(op, pick)
        assert core.state.ledger.gap(core.state.replay.samples, len(core.state.replay)) == (0, 0)
    counts, names = core.counters(), bucket_names(core.state.lengths.edges)
    for kind, flow in (("generated", "arrived"), ("trained", "served"), ("dropped_stale", "dropped_stale")):
        bucketed = sum(counts.get(f"len_{kind}/{name}", 0) for name in names)
        expected = counts[flow] - counts["rejected"] if kind == "generated" else counts[flow]
        assert bucketed == expected, kind
