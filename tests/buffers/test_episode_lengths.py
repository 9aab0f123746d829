"""Drops by episode length in multi-turn runs (`buffers.lengths`): the buckets come from env.max_total_tokens and
env.max_turns when an environment is configured; a sample's turns are the runs of model tokens in its loss mask;
and a hand-made run in which two long episodes (4 turns) arrive last with an older version counts them, by tokens
and by turns, as dropped under fifo and as trained under oldest_first, and a restarted buffer restores the counts."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from buffers.core import BufferCore
from buffers.journal import Journal
from buffers.lengths import length_edges, sample_lengths, sample_turns
from buffers.state import BufferSettings
from common.config import load_config
from common.types import Batch, BatchRequest, LeaseGrant, LeaseRequest, PromptItem, RolloutGroup, VersionReport
from tests.buffers.fakes import GROUP, ask, make_core

TURN_TOKENS, ENV_TOKENS = 16, 4  # model tokens of a turn, environment tokens between two turns
MAX_TOTAL_TOKENS, MAX_TURNS = 64, 4  # length edges 2, 4, ..., 64; turn edges 1, 2, 4


def episode_group(lease_id: int, prompt: PromptItem, turns: int, version: int) -> RolloutGroup:
    """GROUP episodes of `turns` turns of TURN_TOKENS model tokens, ENV_TOKENS environment tokens between turns
    (the layout `actors.environments.trajectory.build_episode_group` makes), every model token sampled by `version`."""
    mask = np.concatenate(
        [np.ones(TURN_TOKENS, np.uint8)] + [np.r_[np.zeros(ENV_TOKENS), np.ones(TURN_TOKENS)]] * (turns - 1)
    ).astype(np.uint8)
    masks = np.tile(mask, GROUP)
    total = len(masks)
    return RolloutGroup(
        lease_id=lease_id,
        prompt_id=prompt.prompt_id,
        epoch=prompt.epoch,
        generator_id=0,
        prompt_tokens=np.arange(5, dtype=np.int32),
        offsets=np.arange(0, total + 1, len(mask), dtype=np.int64),
        completion_tokens=np.ones(total, np.int32),
        behaviour_logprobs=np.where(masks == 1, -0.5, 0.0).astype(np.float32),
        loss_mask=masks,
        token_versions=np.where(masks == 1, version, -1).astype(np.int32),
        versions=np.full(GROUP, version, np.int32),
        rewards=np.arange(GROUP, dtype=np.float32),
        finish_reasons=["done"] * GROUP,
    )


def test_the_buckets_of_a_multi_turn_run_come_from_the_episode_budget() -> None:
    overrides = {"buffer.vocab_size": 100, "generator.max_tokens": 32}
    episodes = {**overrides, "env.environment": "envs.guess:make", "env.max_total_tokens": 1024, "env.max_turns": 8}
    settings = BufferSettings.from_config(load_config(None, episodes))
    assert (settings.max_tokens, settings.max_turns) == (1024, 8)  # not generator.max_tokens: one turn's budget
    single = BufferSettings.from_config(load_config(None, overrides))
    assert (single.max_tokens, single.max_turns) == (32, 0)  # single-turn: no turn buckets
    assert length_edges(1024) == [32, 64, 128, 256, 512, 1024] and length_edges(8) == [1, 2, 4, 8]
    core = make_core(max_tokens=1024, max_turns=8)
    assert {"buffer/len_generated/le_1024", "buffer/turns_generated/le_8", "buffer/turns_dropped_stale/gt_8"} <= set(
        core.metrics()
    )
    assert not any(key.startswith("buffer/turns_") for key in make_core(max_tokens=32).metrics())


def test_sampling_defaults_to_oldest_first_for_multi_turn_runs_only() -> None:
    """buffer.sampling = auto (the default): oldest_first with env.environment (benchmarks/length_bias_episodes:
    the only order that dropped no episode where all could arrive within η), fifo otherwise; a set mode is kept."""
    base = {"buffer.vocab_size": 100}
    episodes = {**base, "env.environment": "envs.guess:make"}
    assert load_config(None, base).buffer.sampling == "auto"
    assert BufferSettings.from_config(load_config(None, episodes)).sampling == "oldest_first"
    assert BufferSettings.from_config(load_config(None, base)).sampling == "fifo"
    for mode in ("fifo", "uniform", "oldest_first"):
        assert BufferSettings.from_config(load_config(None, {**episodes, "buffer.sampling": mode})).sampling == mode
        assert BufferSettings.from_config(load_config(None, {**base, "buffer.sampling": mode})).sampling == mode


def test_turns_are_the_runs_of_model_tokens_of_each_sample() -> None:
    group = episode_group(1, PromptItem(0, 0, [], {}), turns=3, version=0)
    assert sample_turns(group).tolist() == [3] * GROUP
    assert sample_lengths(group).tolist() == [3 * TURN_TOKENS] * GROUP  # environment tokens are not counted
    # samples [1 1 0 1], [0 0], [1 0 1 1 0 1], [1 1], [1]: 2, 0, 3, 1 and 1 turns (a sample that opens with a model
    # token right after one that closed with a model token starts a turn of its own)
    mask = np.array([1, 1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 1, 1, 1, 1], np.uint8)
    offsets = np.array([0, 4, 6, 12, 14, 15], np.int64)
    hand = RolloutGroup(
        lease_id=1,
        prompt_id=0,
        epoch=0,
        generator_id=0,
        prompt_tokens=np.arange(2, dtype=np.int32),
        offsets=offsets,
        completion_tokens=np.zeros(15, np.int32),
        behaviour_logprobs=np.zeros(15, np.float32),
        loss_mask=mask,
        token_versions=np.zeros(15, np.int32),
        versions=np.zeros(5, np.int32),
        rewards=np.zeros(5, np.float32),
        finish_reasons=["done"] * 5,
    )
    assert sample_turns(hand).tolist() == [2, 0, 3, 1, 1]


def _core(sampling: str, journal: Journal | None = None) -> BufferCore:
    return make_core(
        prompts=12,
        journal=journal,
        sampling=sampling,
        max_staleness=1,
        max_tokens=MAX_TOTAL_TOKENS,
        max_turns=MAX_TURNS,
        max_model_len=128,
    )


def _late_long_episodes(core: BufferCore) -> None:
    """B = 2, η = 1 (as tests/buffers/test_lengths.py's run, with episodes). At v0 four prompts are leased: two
    long episodes (4 turns), two short (1 turn). The short ones arrive and step 0 trains them; at v1 two more short
    ones are leased and arrive, and only then the long v0 ones. Steps 1 and 2 follow."""
    first = ask(core, LeaseRequest(0, 4, 0))
    assert isinstance(first, LeaseGrant) and len(first.prompts) == 4
    for prompt in first.prompts[2:]:
        ask(core, episode_group(first.lease_id, prompt, turns=1, version=0))
    _step(core, 0)
    second = ask(core, LeaseRequest(0, 2, 1))
    assert isinstance(second, LeaseGrant) and len(second.prompts) == 2
    for prompt in second.prompts:
        ask(core, episode_group(second.lease_id, prompt, turns=1, version=1))
    for prompt in first.prompts[:2]:
        ask(core, episode_group(first.lease_id, prompt, turns=MAX_TURNS, version=0))
    _step(core, 1)
    _step(core, 2)


def _step(core: BufferCore, step: int) -> None:
    """The learner's step: a batch of B = 2 groups if the buffer has them (checking η), then step + 1 reported."""
    reply = ask(core, BatchRequest(step, 0, 1, 2, 0.0))
    if isinstance(reply, Batch):
        assert all(int(lag.max()) <= core.settings.max_staleness for lag in reply.staleness)
        ask(core, VersionReport(step + 1, step + 1))


def test_drops_are_counted_by_episode_tokens_and_turns() -> None:
    """Generated: 4 short groups x 4 episodes of 1 turn (16 tokens), 2 long x 4 of 4 turns (64 model tokens, and 12
    environment tokens that are not counted). fifo drops the 8 long episodes at step 2 (2 - 0 > η); oldest_first
    trains them at step 1 (1 - 0 <= η)."""
    fifo, oldest = _core("fifo"), _core("oldest_first")
    for core in (fifo, oldest):
        _late_long_episodes(core)
    for values in (fifo.metrics(), oldest.metrics()):
        assert values["buffer/len_generated/le_16"] == 16 and values["buffer/len_generated/le_64"] == 8
        assert values["buffer/turns_generated/le_1"] == 16 and values["buffer/turns_generated/le_4"] == 8
        assert values["buffer/len_generated_mean"] == 32.0  # (16 x 16 + 8 x 64) / 24
        assert values["buffer/turns_generated_mean"] == 2.0  # (16 x 1 + 8 x 4) / 24
        assert values["buffer/turns_drop_rate_shortest"] == 0.0
    dropped = fifo.metrics()
    assert dropped["buffer/turns_dropped_stale/le_4"] == 8 and dropped["buffer/len_dropped_stale/le_64"] == 8
    assert dropped["buffer/turns_trained/le_4"] == 0 and dropped["buffer/turns_trained_mean"] == 1.0
    assert dropped["buffer/turns_drop_rate_longest"] == 1.0 and dropped["buffer/len_drop_rate_longest"] == 1.0
    kept = oldest.metrics()
    assert kept["buffer/turns_trained/le_4"] == 8 and kept["buffer/turns_dropped_stale/le_4"] == 0
    assert kept["buffer/turns_drop_rate_longest"] == 0.0 and kept["buffer/turns_trained_mean"] == 2.0


def test_a_restarted_buffer_restores_the_turn_counts(tmp_path: Path) -> None:
    path = tmp_path / "journal.bin"
    core = _core("fifo", Journal(path))
    core.state.restore(0.0)  # opens the journal for appending
    _late_long_episodes(core)
    core.state.journal.close()
    again = _core("fifo", Journal(path))
    again.state.restore(1.0)
    restored = again.counters()
    assert restored == core.counters() and restored["turns_dropped_stale/le_4"] == 8
    again.state.journal.close()
