"""A curriculum in the buffer: each prompt's pass rate, and (buffer.curriculum = "pass_rate") a lease order that
favours the prompts whose groups carry signal, before any generation is paid for.

    rates = PassRates(pass_reward=1.0)                    # always kept: the metrics below need it
    rates.record(prompt_id, passed=3, samples=8)         # at arrival, stored or filtered (BufferState's appliers)
    bucket = rates.bucket(prompt_id)                      # "unseen", "none", "under_half", "half_or_more", "all"
    order = CurriculumOrder(prompt_ids, seed, epochs, rates, low=0.0, high=1.0, revisit=0.1, signal_share=0.5)
    chosen, cursor = order.draw(count, in_lease, live)  # PromptDispenser.take: [(visit, prompt_id)], the new cursor
    order.advance(cursor, chosen)                         # PromptDispenser.open, live and on journal replay

Why in the buffer. A GRPO group whose samples all pass, or all fail, has advantage 0 everywhere: it teaches nothing
and took a generator's time. Dynamic sampling (`buffers.filtering`) drops such groups after they were generated;
a curriculum avoids leasing them. The buffer owns the dataset cursor and sees every group's rewards, filtered ones
included, so it knows each prompt's pass rate without asking anyone, and its journal keeps it across restarts.

Pass rate. A sample passes when its reward is >= `pass_reward` (buffer.curriculum_pass_reward; 1.0 = the
arithmetic reward's `correct`, whatever the format bonus). A prompt's pass rate is the share of passed samples in
its MOST RECENT group: the policy moves, so an old group says little about today (prime-rl's difficulty pools
likewise take the last rollout's reward). A prompt no group came back for is `unseen`.

Pools and the draw. With low < high (buffer.curriculum_low / _high; default 0 and 1), a prompt is
    hard     pass rate <= low           easy     pass rate >= high
    signal   low < pass rate < high     unseen   never came back
Each slot of a lease is drawn from easy or hard (half each, the other when one is empty) with probability `revisit`
(buffer.curriculum_revisit); otherwise from signal with probability `signal_share` (buffer.curriculum_signal_share,
0.5) and from unseen else. When the chosen pool is empty the next serves: the other of signal and unseen, then easy
and hard. Within a pool the prompt drawn is the one drawn the fewest times so far, ties in a fixed per-seed order: the
signal prompts in rotation, the unseen ones as an epoch would, and every easy and hard prompt comes back at the
revisit rate in turn, so none is starved and a prompt the policy has since learnt or forgotten moves pool.
Why signal and unseen share the draws rather than new prompts first: a prompt whose last group had a spread is more
likely to have one again than a prompt never tried, so drawing it saves generation from the first pass over the
data on; a run shorter than one pass (a large dataset) would otherwise never use what it learnt. signal_share = 0
gives "new prompts first"; 1 drills the signal prompts, leaving the unseen ones for when none is free.
A prompt is never drawn while an instance of it is live (leased and not back, or queued for re-issue): its rate
would be stale, and one live instance per prompt keeps the instance key (visit, prompt_id) unique.

What stays exact. The instance key is (visit, prompt_id), visit = how often the prompt was drawn before: the
dispenser's "epoch" slot, so leases, re-issue, duplicates and the journal work unchanged (`buffers.leases`). The
curriculum chooses WHICH prompts; HOW MANY a generator may start is admission's (`buffers.staleness`), untouched,
so η and the ledger hold as without it. buffer.epochs > 0 bounds the draws to epochs x prompts (a pass over the
dataset is then a number of draws, not every prompt once). The draw is seeded by (run.seed, draws so far), and the
grant records its outcome: replay re-opens the same prompts.

Cost: one heap per pool keyed (visits, order); an entry goes stale when its prompt is drawn or changes pool and is
skipped when met (a prompt gets a new entry when its group comes back). A draw pops O(count + live) entries.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Mapping, Sequence
from typing import Any, Protocol

import numpy as np


class CurriculumSettings(Protocol):
    """The `buffers.state.BufferSettings` fields the curriculum reads."""

    curriculum: str
    seed: int
    epochs: int
    curriculum_low: float
    curriculum_high: float
    curriculum_revisit: float
    curriculum_signal_share: float


BUCKETS = ("unseen", "none", "under_half", "half_or_more", "all")  # pass-rate buckets of the histograms
POOLS = ("signal", "unseen", "easy", "hard")


def pass_bucket(passed: int, samples: int) -> str:
    """The histogram bucket of a pass rate passed / samples: none (0), under_half, half_or_more (< 1), all (1)."""
    if samples <= 0 or passed <= 0:
        return "none"
    if passed >= samples:
        return "all"
    return "under_half" if 2 * passed < samples else "half_or_more"


class PassRates:
    """Each prompt's most recent group: (passed samples, samples). Plain ints, journaled through snapshots."""

    def __init__(self, pass_reward: float = 1.0) -> None:
        self.pass_reward = pass_reward
        self.last: dict[int, tuple[int, int]] = {}

    def passed(self, rewards: np.ndarray) -> int:
        """How many of a group's rewards pass (>= pass_reward)."""
        return int(np.count_nonzero(np.asarray(rewards, dtype=np.float64) >= self.pass_reward))

    def record(self, prompt_id: int, passed: int, samples: int) -> None:
        self.last[prompt_id] = (passed, samples)

    def rate(self, prompt_id: int) -> float | None:
        """The prompt's pass rate, or None if no group came back for it."""
        if prompt_id not in self.last:
            return None
        passed, samples = self.last[prompt_id]
        return passed / max(samples, 1)

    def bucket(self, prompt_id: int) -> str:
        return "unseen" if prompt_id not in self.last else pass_bucket(*self.last[prompt_id])

    def snapshot(self) -> list[list[int]]:
        return [[pid, passed, samples] for pid, (passed, samples) in self.last.items()]

    def restore(self, snapshot: Sequence[Sequence[int]]) -> None:
        self.last = {int(pid): (int(passed), int(samples)) for pid, passed, samples in snapshot}


class CurriculumOrder:
    """The lease order of buffer.curriculum = "pass_rate" (module docstring): `draw` chooses, `advance` commits."""

    def __init__(
        self,
        prompt_ids: Sequence[int],
        seed: int,
        epochs: int,
        rates: PassRates,
        low: float = 0.0,
        high: float = 1.0,
        revisit: float = 0.1,
        signal_share: float = 0.5,
    ) -> None:
        if not 0.0 <= low < high <= 1.0 or not 0.0 <= revisit <= 1.0 or not 0.0 <= signal_share <= 1.0:
            raise ValueError(
                f"need 0 <= low < high <= 1 and revisit, signal_share in [0, 1], got {low}, {high}, {revisit}, "
                f"{signal_share}"
            )
        self.prompt_ids, self.seed, self.epochs, self.rates = list(prompt_ids), seed, epochs, rates
        self.low, self.high, self.revisit, self.signal_share = low, high, revisit, signal_share
        ranks = np.random.default_rng([seed, 0xC0]).permutation(len(self.prompt_ids))
        self.rank = {pid: int(r) for pid, r in zip(self.prompt_ids, ranks)}  # the fixed tie order
        self.visits: dict[int, int] = {}
        self.draws = 0
        self.heaps: dict[str, list[tuple[int, int, int]]] = {}
        self._rebuild()

    # ------------------------------------------------------------------------------------------ the cursor
    @property
    def epoch(self) -> int:
        """Draws so far over the number of prompts: the passes over the dataset, for `buffer/epoch`."""
        return self.draws // len(self.prompt_ids)

    @property
    def exhausted(self) -> bool:
        return self.epochs > 0 and self.draws >= self.epochs * len(self.prompt_ids)

    def pool(self, prompt_id: int) -> str:
        rate = self.rates.rate(prompt_id)
        if rate is None:
            return "unseen"
        if rate <= self.low:
            return "hard"
        return "easy" if rate >= self.high else "signal"

    def draw(
        self, count: int, in_lease: Container[int], live: Mapping[tuple[int, int], Any]
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """Up to `count` instances (visit, prompt_id) of prompts with no live instance and not in `in_lease`, and the
        cursor after them ([draws]). Changes nothing: `advance` does, when the grant opens."""
        busy = {pid for _, pid in live}
        budget = count if self.epochs == 0 else min(count, self.epochs * len(self.prompt_ids) - self.draws)
        rng = np.random.default_rng([self.seed, 0xC1, self.draws])
        chosen: list[tuple[int, int]] = []
        taken: set[int] = set()  # the prompts of `chosen`
        popped: list[tuple[str, tuple[int, int, int]]] = []  # every valid entry met: pushed back before returning
        while len(chosen) < budget:
            entry = self._next(self._sides(rng.random()), busy, in_lease, taken, popped)
            if entry is None:
                break
            chosen.append((entry[0], entry[2]))
            taken.add(entry[2])
        for pool, entry in popped:
            heapq.heappush(self.heaps[pool], entry)
        return chosen, [self.draws + len(chosen)]

    def advance(self, cursor: Sequence[int], prompts: Mapping[int, int]) -> None:
        """A grant opened: its prompts ({prompt_id: visit}) were drawn; the cursor moves to `cursor` ([draws];
        an `EpochOrder`'s [epoch, position], from a journal written before the curriculum was on, moves nothing)."""
        for pid, visit in prompts.items():
            self.visits[pid] = max(self.visits.get(pid, 0), visit + 1)
        if len(cursor) == 1:
            self.draws = max(self.draws, int(cursor[0]))

    def came_back(self, prompt_id: int) -> None:
        """Its group arrived (after `PassRates.record`): the prompt may be drawn again, from its new pool."""
        self._push(prompt_id)

    @property
    def cursor(self) -> list[int]:
        return [self.draws]

    def snapshot(self) -> dict[str, Any]:
        """The dispenser's cursor keys (epoch: one past the highest visit, so that an `EpochOrder` resuming from it
        makes no instance key already used; position 0) and `curriculum`, this order's own state."""
        own = {"draws": self.draws, "visits": [[pid, n] for pid, n in self.visits.items()]}
        return {"epoch": max(self.visits.values(), default=0), "position": 0, "curriculum": own}

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Replace the state (the pass rates are restored first, by the caller) and rebuild the heaps. From an
        `EpochOrder`'s snapshot (the run resumed with the curriculum on): every prompt counts as drawn `epoch` + 1
        times, so no new instance key meets one of that order's (its epoch is at most that)."""
        own = snapshot.get("curriculum")
        if own is None:
            epoch = int(snapshot["epoch"])
            self.draws = epoch * len(self.prompt_ids) + int(snapshot["position"])
            self.visits = dict.fromkeys(self.prompt_ids, epoch + 1)
        else:
            self.draws = int(own["draws"])
            self.visits = {int(pid): int(n) for pid, n in own["visits"]}
        self._rebuild()

    # ------------------------------------------------------------------------------------------ the pools
    def _sides(self, u: float) -> tuple[tuple[str, ...], ...]:
        """The pools to try, in order, for one slot drawn with u ~ U[0, 1) (module docstring)."""
        revisit = ("easy",), ("hard",)
        if u < self.revisit:
            return (*(revisit if u < self.revisit / 2 else revisit[::-1]), ("signal",), ("unseen",))
        wanted = ("signal",), ("unseen",)
        if (u - self.revisit) >= self.signal_share * (1.0 - self.revisit):
            wanted = wanted[::-1]
        return (*wanted, ("easy", "hard"))

    def _next(
        self,
        sides: tuple[tuple[str, ...], ...],
        busy: set[int],
        in_lease: Container[int],
        taken: set[int],
        popped: list[tuple[str, tuple[int, int, int]]],
    ) -> tuple[int, int, int] | None:
        """The least-drawn free prompt of the first side that has one (its entry), or None when every pool is dry."""
        for side in sides:
            best: tuple[str, tuple[int, int, int]] | None = None
            for pool in side:
                entry = self._peek(pool, busy, in_lease, taken, popped)
                if entry is not None and (best is None or entry < best[1]):
                    best = (pool, entry)
            if best is not None:
                pool, entry = best
                popped.append((pool, heapq.heappop(self.heaps[pool])))
                return entry
        return None

    def _peek(
        self,
        pool: str,
        busy: set[int],
        in_lease: Container[int],
        taken: set[int],
        popped: list[tuple[str, tuple[int, int, int]]],
    ) -> tuple[int, int, int] | None:
        """The top valid, free entry of `pool`, left on the heap; stale entries are discarded, busy ones set aside."""
        heap = self.heaps[pool]
        while heap:
            visits, _, pid = heap[0]
            if visits != self.visits.get(pid, 0) or self.pool(pid) != pool:
                heapq.heappop(heap)  # drawn since, or moved pool: its current entry is elsewhere (or comes back)
            elif pid in busy or pid in in_lease or pid in taken:
                popped.append((pool, heapq.heappop(heap)))
            else:
                return heap[0]
        return None

    def _push(self, prompt_id: int) -> None:
        visits = self.visits.get(prompt_id, 0)
        heapq.heappush(self.heaps[self.pool(prompt_id)], (visits, self.rank[prompt_id], prompt_id))

    def _rebuild(self) -> None:
        self.heaps = {pool: [] for pool in POOLS}
        for pid in self.prompt_ids:
            self._push(pid)


def curriculum_order(
    settings: CurriculumSettings, prompt_ids: Sequence[int], rates: PassRates
) -> CurriculumOrder | None:
    """The order buffer.curriculum asks for: a `CurriculumOrder` for "pass_rate", None (the dispenser's epochs) else."""
    if settings.curriculum != "pass_rate":
        return None
    return CurriculumOrder(
        prompt_ids,
        settings.seed,
        settings.epochs,
        rates,
        settings.curriculum_low,
        settings.curriculum_high,
        settings.curriculum_revisit,
        settings.curriculum_signal_share,
    )


def pass_rate_metrics(counts: Mapping[str, int]) -> dict[str, float]:
    """`buffer/pass_<kind>/<bucket>` (kind: leased, generated, trained; 0 where none yet) and
    `buffer/no_signal_share_generated`: the share of arrived groups whose rewards carried no signal (with or without
    the curriculum and the filter), from the ledger events `PassRates` users count."""
    values: dict[str, float] = {}
    for kind in ("leased", "generated", "trained"):
        for bucket in BUCKETS if kind == "leased" else BUCKETS[1:]:
            values[f"buffer/pass_{kind}/{bucket}"] = counts.get(f"pass_{kind}/{bucket}", 0)
    if counts.get("arrived_groups", 0):
        values["buffer/no_signal_share_generated"] = counts.get("groups_no_signal", 0) / counts["arrived_groups"]
    return values
