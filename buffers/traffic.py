"""What the buffer took in and served, for its metrics: bytes of group arrays in and out, the staleness of every
served sample (`buffer/bytes_in`, `buffer/bytes_out`, `buffer/staleness_mean`, `buffer/staleness_max`), and the
generation that fed it: completion tokens of the groups that arrived and completion tokens the generators report
sampling, unfinished samples included (`buffer/tokens_arrived`, `buffer/tokens_sampled`). The learner turns the last
into a generation rate when it waits long for a batch (`learners.stall_report`).

    traffic.arrived(group)                # a group that passed its checks (stored or filtered by dynamic sampling)
    traffic.served(groups, staleness)     # a rank's share of a batch, the first time it is delivered
    traffic.heard(generator_id, tokens)   # a heartbeat's cumulative `tokens` (a restarted generator counts from 0)

Not journalled: a restarted buffer counts from 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.types import RolloutGroup


def group_nbytes(group: RolloutGroup) -> int:
    """Bytes of a group's arrays (what it costs on the wire, within a few hundred bytes of header)."""
    arrays = (
        group.prompt_tokens,
        group.offsets,
        group.completion_tokens,
        group.behaviour_logprobs,
        group.loss_mask,
        group.token_versions,
        group.versions,
        group.rewards,
    )
    return sum(a.nbytes for a in arrays) + sum(a.nbytes for a in group.reward_components.values())


class Traffic:
    """Running totals; `staleness_*` are over served samples (each counted once per delivery of its group)."""

    def __init__(self) -> None:
        self.bytes_in = self.bytes_out = 0
        self.staleness_sum = self.staleness_count = self.staleness_max = 0
        self.tokens_arrived = 0
        self._sampled: dict[int, int] = {}  # generator_id -> its last heartbeat's cumulative tokens
        self._sampled_before = 0  # tokens of generators' earlier lives (a counter that went back: a restart)

    def arrived(self, group: RolloutGroup) -> None:
        self.bytes_in += group_nbytes(group)
        self.tokens_arrived += int(group.completion_tokens.size)

    def heard(self, generator_id: int, tokens: int) -> None:
        """A heartbeat's cumulative token count; a count lower than the last one is a restarted generator, whose
        earlier count is kept, so that `tokens_sampled` never goes back."""
        last = self._sampled.get(generator_id, 0)
        if tokens < last:
            self._sampled_before += last
        self._sampled[generator_id] = tokens

    @property
    def tokens_sampled(self) -> int:
        """Completion tokens every generator heard from reports sampling so far (monotone)."""
        return self._sampled_before + sum(self._sampled.values())

    def generation_counts(self) -> dict[str, int]:
        """`tokens_arrived`, `tokens_sampled`: cumulative since this buffer started (not journalled)."""
        return {"tokens_arrived": self.tokens_arrived, "tokens_sampled": self.tokens_sampled}

    def served(self, groups: Sequence[RolloutGroup], staleness: Sequence[np.ndarray]) -> None:
        """`staleness`: one int array per group of `groups` (`DrawnBatch.share`), each sample's lag in versions."""
        self.bytes_out += sum(group_nbytes(g) for g in groups)
        for lag in staleness:
            self.staleness_sum += int(lag.sum())
            self.staleness_count += lag.size
            self.staleness_max = max(self.staleness_max, int(lag.max()))

    def staleness_metrics(self) -> dict[str, float]:
        """`buffer/staleness_mean` and `buffer/staleness_max`; none before the first served sample."""
        if not self.staleness_count:
            return {}
        return {
            "buffer/staleness_mean": self.staleness_sum / self.staleness_count,
            "buffer/staleness_max": self.staleness_max,
        }
