"""The buffer's ledger: every rollout that arrives is accounted for, in samples and in groups.

    arrived = trained + dropped_stale + dropped_no_signal + evicted + rejected + buffered   (between any two messages)

- arrived: groups that reached the buffer as valid messages (accepted or semantically rejected; duplicates of
  an accepted group are counted in `duplicates` instead, and messages that do not decode are counted per kind in
  `rejected_<kind>` only, since their size is unknown);
- trained: groups retired after their last use (served `max_reuse` times); `served` counts every use;
- dropped_stale: groups dropped at draw time because a sample exceeded the staleness bound;
- dropped_no_signal: groups dropped at arrival, after their checks passed and their lease was completed, because
  their rewards carry no signal (`buffer.filter = "no_signal"`: `buffers.filtering`); never buffered;
- evicted: groups pushed out, oldest first, when the buffer was over capacity;
- rejected: groups that broke the contract or their lease;
- buffered: groups held now (derived from the replay buffer, never counted).
Keys are the sample counts (`trained`) and the group counts (`trained_groups`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

FLOWS = ("arrived", "trained", "served", "dropped_stale", "dropped_no_signal", "evicted", "rejected")
OUTFLOWS = ("trained", "dropped_stale", "dropped_no_signal", "evicted", "rejected")
EVENTS = (
    "duplicates",
    "leases_issued",
    "leases_expired",
    "prompts_reissued",
    "generators_lost",
    "generators_stuck",
)


class Ledger:
    """Monotonic counters of flows (samples and groups) and events; the identity is checked by `gap`."""

    def __init__(self) -> None:
        self.counts: Counter[str] = self._zeros()

    @staticmethod
    def _zeros() -> Counter[str]:
        counts = Counter({key: 0 for key in FLOWS + EVENTS})
        counts.update({f"{key}_groups": 0 for key in FLOWS})
        return counts

    def flow(self, key: str, samples: int, groups: int = 1) -> None:
        """Count `groups` groups of `samples` samples in total under a flow (arrived, trained, ...)."""
        if key not in FLOWS:
            raise KeyError(f"{key!r} is not a flow (one of {FLOWS})")
        self.counts[key] += samples
        self.counts[f"{key}_groups"] += groups

    def event(self, key: str, count: int = 1) -> None:
        """Count an event that is not a flow of samples (duplicates, leases_issued, rejected_<kind>, ...)."""
        self.counts[key] += count

    def replace(self, counts: Mapping[str, int]) -> None:
        """Set every counter (restoring a journal's snapshot); a flow the snapshot lacks (written before that flow
        existed, e.g. dropped_no_signal) is 0."""
        self.counts = self._zeros()
        self.counts.update({key: int(value) for key, value in counts.items()})

    def gap(self, buffered_samples: int, buffered_groups: int) -> tuple[int, int]:
        """arrived - (outflows + buffered), in samples and in groups: (0, 0) whenever the books balance."""
        samples = self.counts["arrived"] - sum(self.counts[k] for k in OUTFLOWS) - buffered_samples
        groups = self.counts["arrived_groups"] - sum(self.counts[f"{k}_groups"] for k in OUTFLOWS) - buffered_groups
        return samples, groups

    def snapshot(self, buffered_samples: int, buffered_groups: int, outstanding: int) -> dict[str, int]:
        """All counters plus the derived ones: buffered(_groups), and admitted (groups that will still be
        trained: trained + buffered + prompts outstanding in leases)."""
        out = {key: int(value) for key, value in self.counts.items()}
        out["buffered"], out["buffered_groups"] = buffered_samples, buffered_groups
        out["outstanding"] = outstanding
        out["admitted"] = self.counts["trained_groups"] + buffered_groups + outstanding
        return out
