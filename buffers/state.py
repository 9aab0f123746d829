"""The buffer's state, changed only through events: `commit` writes an event to the journal, then applies it.

    state = BufferState(settings, prompts, journal)     # journal=None: in memory only
    state.restore(now)                                   # replay the journal (no-op without one)
    lease = state.grant(generator_id, policy_version, count, now)
    seq = state.accept(group, now)                       # may also evict the oldest groups
    batch = state.draw(step, world_size, num_groups)     # None until enough fresh groups are buffered

Live operations and journal replay go through the same `_apply_*` methods, so a restarted buffer holds
exactly what the killed one had committed: its groups, their use counts, the leases, the cursor, the
drawn-but-undelivered batches, the ledger, the filtered-share window of dynamic sampling (a `filtered` record per
group dropped at arrival for carrying no signal: `buffers.filtering`; it holds the group's reward sum and length
tally, so that `no_signal_reward_sum` and the generated length histograms are restored exactly), and the evaluation's rounds and eval leases
(an `eval` record holds the whole `buffers.evaluation.EvalScheduler` snapshot, written after each change to it:
`record_eval`). Decisions (which groups to evict, drop, filter or draw; which prompts to lease; which leases expire)
are made once, live, and recorded; replay applies the recorded outcome.
Counters that are not flows of groups (duplicates, rejections) are restored from the last `counters` event
(written every few seconds), so after a crash they may lag by those seconds; the ledger identity still holds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from buffers.accounting import Ledger
from buffers.batches import BatchBook, DrawnBatch
from buffers.checks import GroupLimits
from buffers.curriculum import PassRates, curriculum_order, pass_bucket
from buffers.evaluation import EvalScheduler
from buffers.filtering import FilterWindow, no_signal
from buffers.journal import Journal
from buffers.leases import Lease, PromptDispenser, PromptRecordLike
from buffers.lengths import LengthCounts
from buffers.replay import ReplayBuffer
from buffers.restore import ReplayGuard
from common.config import TandemConfig
from common.model_prep import model_vocab_size
from common.types import RolloutGroup
from common.wire import encode

log = logging.getLogger("tandem.buffer")


@dataclass(frozen=True)
class BufferSettings:
    """What the buffer reads from the run config (its own section plus the few shared numbers it needs)."""

    capacity: int
    max_reuse: int
    sampling: str
    lease_timeout_s: float
    heartbeat_timeout_s: float
    epochs: int
    group_size: int  # algo.group_size: samples per group
    max_staleness: int  # algo.max_staleness: η
    groups_per_step: int  # learner.groups_per_step: B
    sync_every: int  # learner.sync_every: how far the learner's reports may lag its weights
    seed: int
    stall_timeout_s: float = float("inf")  # buffer.stall_timeout_s: heartbeats without progress (buffers.leases)
    # What a group may hold (buffers.checks.group_problem). The defaults are the widest the config allows (any
    # int32 id, model.max_model_len's upper bound); `from_config` always sets the run's own.
    vocab_size: int = 2**31  # buffer.vocab_size, else the model's
    max_model_len: int = 131072  # model.max_model_len
    max_abs_reward: float = 1e6  # buffer.max_abs_reward
    # The top edge of the length buckets (buffers.lengths): generator.max_tokens, or env.max_total_tokens with an
    # environment (TandemConfig.overlong_budget: an episode's model tokens); and env.max_turns, the top edge of the
    # turn buckets, with an environment (0: single-turn, no turn buckets).
    max_tokens: int = 128
    max_turns: int = 0
    # Dynamic sampling (buffers.filtering); the defaults are the config's (off).
    filter: str = "none"  # buffer.filter: "none" or "no_signal"
    min_reward_spread: float = 0.0  # buffer.min_reward_spread
    max_filtered_share: float = 0.9  # buffer.max_filtered_share
    filter_window: int = 32  # buffer.filter_window: arrivals in the filtered-share estimate
    # The curriculum (buffers.curriculum); the defaults are the config's (off; the pass rates are kept regardless).
    curriculum: str = "none"  # buffer.curriculum: "none" or "pass_rate"
    curriculum_low: float = 0.0
    curriculum_high: float = 1.0
    curriculum_revisit: float = 0.1
    curriculum_signal_share: float = 0.5
    pass_reward: float = 1.0  # buffer.curriculum_pass_reward

    @classmethod
    def from_config(cls, config: TandemConfig) -> BufferSettings:
        """The run's settings; the vocabulary size is read from the model's config.json unless buffer.vocab_size
        sets it (raises saying what to set when neither gives one)."""
        b = config.buffer
        return cls(
            b.capacity,
            b.max_reuse,
            config.buffer_sampling,  # buffer.sampling, `auto` resolved by env.environment
            b.lease_timeout_s,
            b.heartbeat_timeout_s,
            b.epochs,
            config.algo.group_size,
            config.algo.max_staleness,
            config.learner.groups_per_step,
            config.learner.sync_every,
            config.run.seed,
            b.stall_timeout_s,
            b.vocab_size or model_vocab_size(config.model.path),
            config.model.max_model_len,
            b.max_abs_reward,
            max_tokens=config.overlong_budget,
            max_turns=config.env.max_turns if config.env.environment else 0,
            filter=b.filter,
            min_reward_spread=b.min_reward_spread,
            max_filtered_share=b.max_filtered_share,
            filter_window=b.filter_window,
            curriculum=b.curriculum,
            curriculum_low=b.curriculum_low,
            curriculum_high=b.curriculum_high,
            curriculum_revisit=b.curriculum_revisit,
            curriculum_signal_share=b.curriculum_signal_share,
            pass_reward=b.curriculum_pass_reward,
        )

    @property
    def group_limits(self) -> GroupLimits:
        return GroupLimits(self.group_size, self.vocab_size, self.max_model_len, self.max_abs_reward)


class BufferState:
    """Dispenser + replay buffer + batch book + ledger + the learner's version, changed only by events."""

    def __init__(
        self,
        settings: BufferSettings,
        prompts: Sequence[PromptRecordLike],
        journal: Journal | None,
        evaluation: EvalScheduler | None = None,
    ) -> None:
        """`evaluation`: the eval rounds and leases (None: eval.sets is empty, and nothing here evaluates)."""
        self.settings = settings
        self.journal = journal
        self.evaluation = evaluation
        self.pass_rates = PassRates(settings.pass_reward)  # each prompt's last group (buffers.curriculum)
        self.dispenser = PromptDispenser(
            prompts,
            settings.seed,
            settings.epochs,
            settings.lease_timeout_s,
            settings.heartbeat_timeout_s,
            stall_timeout_s=settings.stall_timeout_s,
            order=curriculum_order(settings, [p.prompt_id for p in prompts], self.pass_rates),
        )
        self.replay = ReplayBuffer(settings.capacity, settings.max_reuse, settings.sampling, settings.seed)
        self.book = BatchBook()
        self.ledger = Ledger()
        # samples by length (and turn) bucket (ledger events)
        self.lengths = LengthCounts(self.ledger, settings.max_tokens, settings.max_turns)
        self.filter_window = FilterWindow(settings.filter_window)  # arrivals kept or filtered (buffers.filtering)
        # The rewards of every filtered sample, summed in float64 (a float: the ledger counts integers). With
        # dropped_no_signal it gives back the mean reward of all generated samples (benchmarks.time_to_reward).
        self.no_signal_reward_sum = 0.0
        self.learner_version = 0  # V: the learner's step from its last VersionReport
        self.policy_version = 0  # the newest weights version it reported publishing
        # Trained groups that the learner's current timeline does not know: set when a learner reports an older step
        # than before (it resumed from an older checkpoint), so that admission counts V·B trained groups again.
        self.trained_offset = 0
        # The lowest step a new batch may be drawn for (one past the last draw, or the step a learner re-announced)
        # and the (world_size, num_groups) of the last draw: see buffers.authority for the rules they enforce.
        self.draw_floor = 0
        self.drawn_high = 0  # one past the highest step ever drawn (never lowered: bounds every reported step)
        self.batch_shape: tuple[int, int] | None = None
        self.next_seq = 1  # arrival number of the next accepted group
        self._held: dict[int, RolloutGroup] = {}  # during restore: groups only a pending draw still holds
        self._saved_counts: dict[str, int] = {}
        self._appliers = {
            "grant": self._apply_grant,
            "group": self._apply_group,
            "filtered": self._apply_filtered,
            "evict": self._apply_evict,
            "drop": self._apply_drop,
            "draw": self._apply_draw,
            "deliver": self._apply_deliver,
            "expire": self._apply_expire,
            "requeue": self._apply_requeue,
            "version": self._apply_version,
            "counters": self._apply_counters,
            "leases": self._apply_leases,
            "pending_draw": self._apply_pending_draw,
            "eval": self._apply_eval,
        }

    # ------------------------------------------------------------------------------------------ events
    def commit(self, kind: str, meta: dict[str, Any], group: RolloutGroup | None = None) -> Any:
        """Journal the event (when persistent), then apply it; returns what the applier returns. An event whose
        applier raises is taken back out of the journal (`Journal.retract`) before the error propagates: what failed
        live is not replayed into the restarted buffer (issue 37)."""
        if self.journal is None:
            return self.apply(kind, meta, group)
        before = self.journal.size
        self.journal.append(kind, meta, encode(group) if group is not None else ())
        try:
            return self.apply(kind, meta, group)
        except Exception:
            self.journal.retract(before)
            raise

    def apply(self, kind: str, meta: dict[str, Any], group: RolloutGroup | None = None) -> Any:
        """Apply an event without journaling it (`commit` after journaling it, replay as it reads it)."""
        return self._appliers[kind](meta, group)

    def restore(self, now: float) -> int:
        """Replay the journal (if any) into this fresh state, as of `now`; returns the number of events applied.

        A record that fails its checks is skipped, logged and counted (`journal_skipped`), never fatal (see
        `buffers.restore`): a group that does not decode or that `group_problem` rejects now, numbers outside the
        wire's bounds (`journal_record_problem`), and records that refer to a skipped group or to a batch that is not
        there. An unknown record kind still raises (the journal was written by a newer version)."""
        if self.journal is None:
            return 0
        records = self.journal.replay()
        guard = ReplayGuard(self)
        for record in records:
            if record.kind not in self._appliers:
                raise ValueError(
                    f"{self.journal.path}: unknown record kind {record.kind!r} (written by a newer "
                    "version?): run that version, or start a new run.name"
                )
            guard.replay(record)
        self._held.clear()
        self.dispenser.restart(now)
        if self.evaluation is not None:  # an eval lease's holder gets a fresh heartbeat window too
            for lease in self.evaluation.leases.values():
                if lease.state == "active":
                    self.dispenser.seen(lease.generator_id, now)
        self.dispenser.forget(now)
        if guard.skipped:
            log.error(
                "journal %s: skipped %d of %d records (counted: journal_skipped)",
                self.journal.path,
                guard.skipped,
                len(records),
            )
        return len(records) - guard.skipped

    # ------------------------------------------------------------------------------------------ live operations
    @property
    def newest_version(self) -> int:
        """The newest policy_version any generator may hold: reports lag publishing by < sync_every steps."""
        return self.learner_version + self.settings.sync_every

    def grant(self, generator_id: int, policy_version: int, count: int, now: float) -> Lease | None:
        grant = self.dispenser.take(generator_id, policy_version, count, now)
        return None if grant is None else self.commit("grant", grant)

    def accept(self, group: RolloutGroup, now: float) -> tuple[int, int]:
        """Store an accepted group (already checked); returns (its seq, samples evicted to make room)."""
        seq = self.next_seq
        self.commit("group", {"seq": seq, "lease_id": group.lease_id, "prompt_id": group.prompt_id, "t": now}, group)
        victims = self.replay.over_capacity()
        evicted = sum(self.replay.entries[s].samples for s in victims)
        if victims:
            self.commit("evict", {"seqs": victims})
        return seq, evicted

    def filter_out(self, group: RolloutGroup, now: float) -> None:
        """Drop an accepted group (already checked) that carries no signal: its prompt is done (the lease completes
        as for a stored group), it counts as arrived and dropped_no_signal, and its content is not kept (the
        journal record holds the ids, the size, the rewards' float64 sum and the length tally: enough for replay
        to do the same and to count the same sums)."""
        meta = {
            "lease_id": group.lease_id,
            "prompt_id": group.prompt_id,
            "samples": group.size,
            "reward_sum": float(np.sum(group.rewards, dtype=np.float64)),
            "passed": self.pass_rates.passed(group.rewards),
            "lengths": self.lengths.tally(group),
            "t": now,
        }
        self.commit("filtered", meta)

    def drop_stale(self, step: int) -> int:
        """Drop every buffered group with a sample too stale for `step`; returns the samples dropped."""
        stale = self.replay.too_stale(step, self.settings.max_staleness)
        if not stale:
            return 0
        return self.commit("drop", {"step": step, "seqs": stale})

    def draw(self, step: int, world_size: int, num_groups: int) -> DrawnBatch | None:
        """Draw the global batch of `step` once (call `drop_stale(step)` first), or None if too few groups."""
        seqs = self.replay.choose(num_groups)
        if seqs is None:
            return None
        return self.commit("draw", {"step": step, "world_size": world_size, "seqs": seqs})

    def deliver(self, step: int, rank: int) -> None:
        self.commit("deliver", {"step": step, "rank": rank})

    def expire(self, lease_ids: list[int], now: float) -> None:
        self.commit("expire", {"lease_ids": lease_ids, "t": now})

    def requeue(self, lease_id: int, prompt_ids: list[int], now: float) -> None:
        self.commit("requeue", {"lease_id": lease_id, "prompt_ids": prompt_ids, "t": now})

    def report_version(self, step: int, policy_version: int, resync: bool = False) -> None:
        """`resync`: the learner announced itself (start or resume): it may move back, and re-opens the draws."""
        meta = {"step": step, "policy_version": policy_version}
        self.commit("version", {**meta, "resync": True} if resync else meta)

    def record_eval(self, now: float) -> None:
        """Journal the evaluation's state after a live change to it (its snapshot: replay restores it)."""
        if self.journal is not None and self.evaluation is not None:
            self.journal.append("eval", {"snapshot": self.evaluation.snapshot(), "t": now})

    def save_counters(self) -> None:
        """Record the ledger if it changed (so counters that are not group flows survive a restart)."""
        counts = dict(self.ledger.counts)
        if self.journal is not None and counts != self._saved_counts:  # a filtered group changes counts and sum
            meta = {"counts": counts, "next_seq": self.next_seq, "no_signal_reward_sum": self.no_signal_reward_sum}
            self.commit("counters", meta)
            self._saved_counts = counts

    def compact(self, now: float) -> None:
        """Rewrite the journal as the live state only (see `live_records`)."""
        if self.journal is not None:
            self.journal.rewrite(self.live_records(now))

    def live_records(self, now: float) -> Iterator[tuple[str, dict[str, Any], list]]:
        """The events that rebuild the current state from nothing: version, leases, the groups still buffered
        or held by a drawn batch (undelivered, or the last completed one, kept for a retry), those batches,
        the evaluation's state, and the ledger last (it overwrites every counter)."""
        yield (
            "version",
            {
                "step": self.learner_version,
                "policy_version": self.policy_version,
                "trained_offset": self.trained_offset,
                "draw_floor": self.draw_floor,
                "drawn_high": self.drawn_high,
                "batch_shape": list(self.batch_shape) if self.batch_shape else None,
            },
            [],
        )
        yield "leases", {"snapshot": self.dispenser.snapshot(), "pass_rates": self.pass_rates.snapshot(), "t": now}, []
        batches = [*self.book.drawn.values(), *([self.book.completed] if self.book.completed else [])]
        written: set[int] = set()
        for batch in batches:
            for seq, group in zip(batch.seqs, batch.groups):
                if seq not in self.replay and seq not in written:
                    written.add(seq)
                    yield "group", {"seq": seq, "complete": False, "held": True}, encode(group)
        for entry in self.replay.entries.values():
            yield "group", {"seq": entry.seq, "complete": False, "uses": entry.uses}, encode(entry.group)
        for batch in batches:
            yield (
                "pending_draw",
                {
                    "step": batch.step,
                    "world_size": batch.world_size,
                    "seqs": batch.seqs,
                    "delivered": sorted(batch.delivered),
                },
                [],
            )
        if self.evaluation is not None:
            yield "eval", {"snapshot": self.evaluation.snapshot(), "t": now}, []
        counters = {
            "counts": dict(self.ledger.counts),
            "next_seq": self.next_seq,
            "no_signal_reward_sum": self.no_signal_reward_sum,
        }
        yield "counters", {**counters, "filter_window": self.filter_window.snapshot()}, []

    # ------------------------------------------------------------------------------------------ appliers
    def _apply_grant(self, meta: dict[str, Any], _: Any) -> Lease:
        self.ledger.event("leases_issued")
        for prompt_id, _epoch in meta["prompts"]:
            self.ledger.event(f"pass_leased/{self.pass_rates.bucket(prompt_id)}")
        return self.dispenser.open(meta)

    def _apply_group(self, meta: dict[str, Any], group: RolloutGroup) -> None:
        seq = meta["seq"]
        self.next_seq = max(self.next_seq, seq + 1)
        if meta.get("held"):
            self._held[seq] = group
            return
        self.replay.add(seq, group, meta.get("uses", 0))
        if meta.get("complete", True):
            self.dispenser.complete(meta["lease_id"], meta["prompt_id"], meta["t"])
            self.ledger.flow("arrived", group.size)
            self.lengths.count("generated", [group])
            self.filter_window.record(False)
            self._came_back(group.prompt_id, self.pass_rates.passed(group.rewards), group.size)
            if no_signal(group.rewards, self.settings.min_reward_spread):
                self.ledger.event("groups_no_signal")

    def _apply_filtered(self, meta: dict[str, Any], _: Any) -> None:
        self.dispenser.complete(meta["lease_id"], meta["prompt_id"], meta["t"])
        self.ledger.flow("arrived", meta["samples"])
        self.ledger.flow("dropped_no_signal", meta["samples"])
        self.no_signal_reward_sum += meta.get("reward_sum", 0.0)  # a record written before the sum was kept: 0
        if "lengths" in meta:  # likewise: such a record's group is missing from the generated lengths
            self.lengths.add("generated", meta["lengths"])
        self.filter_window.record(True)
        self.ledger.event("groups_no_signal")
        if "passed" in meta:  # a record written before the pass rates were kept: its prompt keeps its old rate
            self._came_back(meta["prompt_id"], meta["passed"], meta["samples"])

    def _came_back(self, prompt_id: int, passed: int, samples: int) -> None:
        """A prompt's group arrived, stored or filtered: its pass rate, the generated histogram, the order's pools."""
        self.pass_rates.record(prompt_id, passed, samples)
        self.ledger.event(f"pass_generated/{pass_bucket(passed, samples)}")
        self.dispenser.order.came_back(prompt_id)

    def _apply_evict(self, meta: dict[str, Any], _: Any) -> int:
        removed = self.replay.remove(meta["seqs"])
        samples = sum(entry.samples for entry in removed)
        self.ledger.flow("evicted", samples, len(removed))
        return samples

    def _apply_drop(self, meta: dict[str, Any], _: Any) -> int:
        removed = self.replay.remove(meta["seqs"])
        samples = sum(entry.samples for entry in removed)
        self.ledger.flow("dropped_stale", samples, len(removed))
        self.lengths.count("dropped_stale", (entry.group for entry in removed))
        return samples

    def _apply_draw(self, meta: dict[str, Any], _: Any) -> DrawnBatch:
        served, retired = self.replay.use(meta["seqs"])
        self.ledger.flow("served", sum(e.samples for e in served), len(served))
        self.ledger.flow("trained", sum(e.samples for e in retired), len(retired))
        self.lengths.count("trained", (e.group for e in served))
        for entry in served:
            passed = self.pass_rates.passed(entry.group.rewards)
            self.ledger.event(f"pass_trained/{pass_bucket(passed, entry.group.size)}")
        batch = DrawnBatch.split(meta["step"], meta["world_size"], meta["seqs"], [e.group for e in served])
        self.book.add(batch)
        self.draw_floor = max(self.draw_floor, batch.step + 1)
        self.drawn_high = max(self.drawn_high, batch.step + 1)
        self.batch_shape = (batch.world_size, batch.num_groups)
        return batch

    def _apply_deliver(self, meta: dict[str, Any], _: Any) -> None:
        self.book.deliver(meta["step"], meta["rank"])

    def _apply_expire(self, meta: dict[str, Any], _: Any) -> None:
        requeued = self.dispenser.expire(meta["lease_ids"], meta["t"])
        self.ledger.event("leases_expired", len(meta["lease_ids"]))
        self.ledger.event("prompts_reissued", requeued)

    def _apply_requeue(self, meta: dict[str, Any], _: Any) -> None:
        self.ledger.event("prompts_reissued", self.dispenser.requeue(meta["lease_id"], meta["prompt_ids"], meta["t"]))

    def _apply_version(self, meta: dict[str, Any], _: Any) -> None:
        step = meta["step"]
        if "trained_offset" in meta:  # a compacted journal's snapshot
            self.trained_offset = meta["trained_offset"]
            self.draw_floor = meta.get("draw_floor", step)
            self.drawn_high = max(self.drawn_high, meta.get("drawn_high", step))
            self.batch_shape = tuple(meta["batch_shape"]) if meta.get("batch_shape") else None
        else:
            if step < self.learner_version:  # the learner resumed from an older checkpoint: re-base admission
                self.trained_offset = self.ledger.counts["trained_groups"] - step * self.settings.groups_per_step
            if meta.get("resync"):  # the learner (re)started at `step`: its draws start there, of any shape
                self.draw_floor, self.batch_shape = step, None
            else:
                self.draw_floor = max(self.draw_floor, step)
        self.learner_version, self.policy_version = step, meta["policy_version"]

    def _apply_counters(self, meta: dict[str, Any], _: Any) -> None:
        self.ledger.replace(meta["counts"])
        self.next_seq = max(self.next_seq, meta["next_seq"])
        if "no_signal_reward_sum" in meta:  # the live sum when written (replay summed the same records to it)
            self.no_signal_reward_sum = float(meta["no_signal_reward_sum"])
        if "filter_window" in meta:  # a compacted journal: its arrivals' records are gone, the window is here
            self.filter_window.restore(meta["filter_window"])

    def _apply_leases(self, meta: dict[str, Any], _: Any) -> None:
        if "pass_rates" in meta:  # before the dispenser: a curriculum's pools are rebuilt from them
            self.pass_rates.restore(meta["pass_rates"])
        self.dispenser.restore(meta["snapshot"], meta["t"])

    def _apply_pending_draw(self, meta: dict[str, Any], _: Any) -> None:
        groups = [self.replay.entries[s].group if s in self.replay else self._held[s] for s in meta["seqs"]]
        batch = DrawnBatch.split(meta["step"], meta["world_size"], meta["seqs"], groups)
        batch.delivered.update(meta["delivered"])
        self.drawn_high = max(self.drawn_high, batch.step + 1)
        if len(batch.delivered) == batch.world_size:
            self.book.completed = batch
        else:
            self.book.add(batch)

    def _apply_eval(self, meta: dict[str, Any], _: Any) -> None:
        if self.evaluation is not None:  # a journal of a run that evaluated, resumed with eval.sets empty: ignored
            self.evaluation.restore(meta["snapshot"], meta["t"])
