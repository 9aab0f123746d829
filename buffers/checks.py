"""Semantic checks of well-formed messages (the wire already checked types, shapes and alignment).

Each function returns None when the message is acceptable, else (kind, reason): `kind` is the short key the
rejection is counted under (`rejected_<kind>`), `reason` the sentence sent back to the peer and logged, saying
what to change. They are pure functions of the message and the numbers they are given.
"""

from __future__ import annotations

import numpy as np

from common.types import BatchRequest, Heartbeat, LeaseRequest, LeaseReturn, RolloutGroup, VersionReport

Problem = tuple[str, str] | None
MAX_BATCH_WAIT_S = 600.0  # a held BatchRequest is answered BatchNotReady after at most this long
_NO_TOKEN = np.iinfo(np.int32).max


def group_problem(group: RolloutGroup, group_size: int, newest_version: int) -> Problem:
    """Size and versions of a rollout group: n == algo.group_size; 0 <= versions <= newest_version; and each
    sample's version is no newer than the oldest of its model tokens (else its staleness would be understated)."""
    if group.size != group_size:
        return "wrong_group_size", f"group has {group.size} samples, algo.group_size is {group_size}"
    versions = group.versions
    if versions.min() < 0:
        return "bad_version", f"versions must be >= 0 (got min {int(versions.min())})"
    if versions.max() > newest_version:
        return "future_version", (
            f"versions up to {int(versions.max())}, but the learner has published at most {newest_version}"
        )
    sample = _sample_newer_than_its_tokens(group)
    if sample is not None:
        return "bad_version", (
            f"sample {sample}: versions[{sample}] = {int(versions[sample])} is newer than its oldest model "
            f"token's version; versions must be the oldest policy_version behind each sample"
        )
    return None


def _sample_newer_than_its_tokens(group: RolloutGroup) -> int | None:
    """The first sample whose `versions` entry is newer than one of its model tokens (loss_mask = 1), or None.
    Fast path (every token is a model token, none older than the newest sample version): two reductions."""
    versions, token_versions = group.versions, group.token_versions
    if group.loss_mask.min(initial=1) == 1:
        if token_versions.min(initial=_NO_TOKEN) >= versions.max():
            return None
        model_tokens = token_versions
    else:
        model_tokens = np.where(group.loss_mask == 1, token_versions, _NO_TOKEN)
    starts = group.offsets[:-1]
    nonempty = starts < group.offsets[1:]
    if not nonempty.any():
        return None
    oldest = np.minimum.reduceat(model_tokens, starts[nonempty])
    newer = versions[nonempty] > oldest
    return int(np.flatnonzero(nonempty)[np.argmax(newer)]) if newer.any() else None


def lease_request_problem(request: LeaseRequest, newest_version: int) -> Problem:
    if request.generator_id < 0:
        return "bad_generator", f"generator_id must be >= 0 (got {request.generator_id})"
    if request.max_prompts < 1:
        return "bad_lease_request", f"max_prompts must be >= 1 (got {request.max_prompts})"
    if not 0 <= request.policy_version <= newest_version:
        return "future_version", (
            f"policy_version {request.policy_version} is not in [0, {newest_version}] (the newest version the "
            "learner can have published): send the version of the weights loaded"
        )
    return None


def heartbeat_problem(heartbeat: Heartbeat, newest_version: int) -> Problem:
    if heartbeat.generator_id < 0:
        return "bad_generator", f"generator_id must be >= 0 (got {heartbeat.generator_id})"
    if not 0 <= heartbeat.policy_version <= newest_version:
        return "future_version", f"policy_version {heartbeat.policy_version} is not in [0, {newest_version}]"
    return None


def lease_return_problem(returned: LeaseReturn, lease_generator: int | None, lease_prompts: set[int]) -> Problem:
    """`lease_generator` is None when the lease is unknown."""
    if lease_generator is None:
        return "unknown_lease", f"lease {returned.lease_id} is unknown"
    if lease_generator != returned.generator_id:
        return "wrong_generator", f"lease {returned.lease_id} belongs to generator {lease_generator}"
    foreign = sorted(set(returned.prompt_ids) - lease_prompts)
    if foreign:
        return "prompt_not_in_lease", f"prompts {foreign[:8]} are not part of lease {returned.lease_id}"
    return None


def batch_request_problem(
    request: BatchRequest, capacity_groups: int, learner_version: int, sync_every: int
) -> Problem:
    """rank < world_size, num_groups a positive multiple of world_size that fits the buffer, a sane timeout,
    and a step the buffer can believe (at most sync_every ahead of the last VersionReport)."""
    if request.world_size < 1 or not 0 <= request.rank < request.world_size:
        return "bad_rank", f"rank {request.rank} is not in [0, world_size = {request.world_size})"
    if request.num_groups < 1 or request.num_groups % request.world_size:
        return "bad_num_groups", (
            f"num_groups {request.num_groups} must be a positive multiple of world_size {request.world_size}"
        )
    if request.num_groups > capacity_groups:
        return "bad_num_groups", (
            f"num_groups {request.num_groups} can never be served: buffer.capacity holds {capacity_groups} groups"
        )
    if not 0 <= request.timeout_s <= MAX_BATCH_WAIT_S:  # also refuses NaN
        return "bad_timeout", f"timeout_s must be in [0, {MAX_BATCH_WAIT_S:.0f}] (got {request.timeout_s})"
    if not 0 <= request.step <= learner_version + sync_every:
        return "bad_step", (
            f"step {request.step} is not in [0, {learner_version + sync_every}]: the last VersionReport said step "
            f"{learner_version} (send a VersionReport after publishing weights, before asking for later steps)"
        )
    return None


def version_report_problem(report: VersionReport) -> Problem:
    if report.step < 0 or not 0 <= report.policy_version <= report.step:
        return "bad_version", (
            f"need 0 <= policy_version <= step (got policy_version {report.policy_version}, step {report.step})"
        )
    return None
