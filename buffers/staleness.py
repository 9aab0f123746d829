"""The staleness bound η, enforced twice: when prompts are leased (admission control) and when a batch is drawn.

Notation (all counts in groups, one group = the `n` samples of one prompt):
    B  learner.groups_per_step, the groups of one global batch
    η  algo.max_staleness
    V  the learner's step from its last `VersionReport` (0 before the first)
    v  the policy_version of the weights a generator samples with
    staleness of a sample trained at step s = s - (the oldest policy_version behind its tokens)

Admission (AReaL's rule). Number the groups that will still be trained in the order they are admitted:
`admitted` = trained + buffered + prompts outstanding in leases (not the dropped, evicted or rejected ones,
which will never be trained). The m-th such group (0-based) is admitted only if m < (v + η + 1)·B. With FIFO
consumption each step trains the next B groups, so group m is trained at step ⌊m / B⌋ ≤ v + η: its staleness
is at most η. A generator whose weights are already too old (v < V - η) is refused outright ("stale") and told
the version it must load; a generator whose quota is used up is refused ("full") and waits for the learner.
With η = 0 this is synchronous on-policy training through the same code path: (v + 1)·B groups per version.

The argument needs FIFO consumption in admission order. Groups that arrive out of lease order (long completions
finish last, so they do: `buffers.lengths`), uniform sampling, reuse (max_reuse > 1) or a buffer restarted without its
journal can all break it; hence the second, hard enforcement: when a batch for step s is drawn, every group with a sample whose s - version > η is dropped
(counted as dropped_stale). No served sample ever exceeds η, whatever the admission rule let through.
buffer.sampling = "oldest_first" (`buffers.replay`) draws the oldest version first, ties in lease order: closest to
admission order, so that a late group is trained before it expires rather than dropped behind younger ones.

Everything here is a pure function of its arguments (unit- and property-tested alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RETRY_FULL_S = 0.25  # how long a generator refused for admission control ("full") waits before asking again
RETRY_STALE_S = 0.5  # ... refused as "stale" (it fetches newer weights meanwhile)


@dataclass(frozen=True)
class Admission:
    """The decision on one lease request: `granted` prompts may be leased (0 = refused for `refusal`)."""

    granted: int
    refusal: str = ""  # "" (granted), "stale" (load weights >= min_version first), "full" (wait for the learner)
    min_version: int = 0  # the oldest policy_version the buffer still accepts leases for: V - η (>= 0)


def admission_quota(policy_version: int, max_staleness: int, groups_per_step: int, admitted: int) -> int:
    """Groups a generator at `policy_version` may still start: (v + η + 1)·B - admitted (may be <= 0)."""
    return (policy_version + max_staleness + 1) * groups_per_step - admitted


def admit(
    requested: int,
    policy_version: int,
    learner_version: int,
    max_staleness: int,
    groups_per_step: int,
    admitted: int,
) -> Admission:
    """Decide a lease request for `requested` prompts from a generator holding weights `policy_version`.

    Refuses "stale" when v < V - η (its samples would be too old the moment they arrive), otherwise grants
    min(requested, (v + η + 1)·B - admitted) prompts, refusing "full" when that is <= 0.
    """
    if requested < 1:
        raise ValueError(f"requested: must be >= 1 prompt (got {requested})")
    min_version = max(0, learner_version - max_staleness)
    if policy_version < min_version:
        return Admission(0, "stale", min_version)
    granted = min(requested, admission_quota(policy_version, max_staleness, groups_per_step, admitted))
    if granted <= 0:
        return Admission(0, "full", min_version)
    return Admission(granted, "", min_version)


def sample_staleness(step: int, versions: np.ndarray) -> np.ndarray:
    """int32 [n]: how many policy versions each sample lags the learner at `step` (step - versions)."""
    return (np.int64(step) - versions.astype(np.int64)).astype(np.int32)


def is_too_stale(step: int, oldest_version: int, max_staleness: int) -> bool:
    """True when a group whose oldest sample has `oldest_version` may not be trained at `step`."""
    return step - oldest_version > max_staleness


def stale_positions(step: int, oldest_versions: list[int], max_staleness: int) -> list[int]:
    """Positions (in the given order) of the groups that must be dropped before drawing the batch of `step`."""
    return [i for i, oldest in enumerate(oldest_versions) if is_too_stale(step, oldest, max_staleness)]
