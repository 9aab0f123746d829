"""Semantic checks of well-formed messages (the wire already checked types, shapes and alignment).

Each function returns None when the message is acceptable, else (kind, reason): `kind` is the short key the
rejection is counted under (`rejected_<kind>`), `reason` the sentence sent back to the peer and logged, saying
what to change. They are pure functions of the message and the numbers they are given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.types import (
    MAX_COUNT,
    MAX_FINISH_REASON_CHARS,
    MAX_NAME_CHARS,
    MAX_REWARD_COMPONENTS,
    MAX_VERSION,
    BatchRequest,
    Heartbeat,
    LeaseRequest,
    LeaseReturn,
    RolloutGroup,
    VersionReport,
)

Problem = tuple[str, str] | None


class RequestRejected(Exception):
    """A well-formed message the buffer refuses; `kind` is counted, `reason` is sent back and logged."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind, self.reason = kind, reason


MAX_BATCH_WAIT_S = 600.0  # a held BatchRequest is answered BatchNotReady after at most this long
_NO_TOKEN = np.iinfo(np.int32).max


@dataclass(frozen=True)
class GroupLimits:
    """What a group may hold (from the run config: `BufferSettings.group_limits`)."""

    group_size: int  # algo.group_size: samples per group
    vocab_size: int  # token ids are [0, vocab_size)
    max_model_len: int  # model.max_model_len: prompt + completion tokens of one sample, at most
    max_abs_reward: float  # buffer.max_abs_reward: |reward| and |component| at most


def group_problem(group: RolloutGroup, limits: GroupLimits, newest_version: int) -> Problem:
    """The content of a rollout group, cheapest checks first (kinds in brackets):
    - n == algo.group_size [wrong_group_size];
    - a prompt of 1 to max_model_len - 1 tokens [empty_prompt, too_long], prompt + completion <= max_model_len
      for every sample [too_long], and at least one completion token in the group [empty_completion] (one sample
      may be empty: an episode that failed before its first turn carries its failure reward, and no token);
    - at most MAX_REWARD_COMPONENTS components with names and finish reasons within their lengths [too_large]
      (with the lengths above, a group's memory is bounded by `common.types.max_group_bytes`);
    - token ids (prompt and completion) within [0, vocab_size) [bad_token];
    - rewards and components finite, |value| <= max_abs_reward [bad_reward];
    - behaviour log-probs finite and <= 0 [bad_logprob];
    - 0 <= versions <= newest_version, token versions within [-1, newest_version] [bad_version,
      future_version], and each sample's version no newer than the oldest of its model tokens (else its staleness
      would be understated) [bad_version].
    Cost: a few reductions over the group's arrays (a group of 8 x 1,008 tokens after a 16-token prompt: ~65 us here).
    """
    return (
        _shape_problem(group, limits)
        or _token_problem(group, limits.vocab_size)
        or _value_problem(group, limits.max_abs_reward)
        or _version_problem(group, newest_version)
    )


def _shape_problem(group: RolloutGroup, limits: GroupLimits) -> Problem:
    if group.size != limits.group_size:
        return "wrong_group_size", f"group has {group.size} samples, algo.group_size is {limits.group_size}"
    prompt, max_len = len(group.prompt_tokens), limits.max_model_len
    if prompt == 0:
        return "empty_prompt", "prompt_tokens is empty: send the rendered prompt the completions continue"
    if prompt >= max_len:
        return "too_long", f"prompt of {prompt} tokens leaves no room for a completion in model.max_model_len {max_len}"
    longest = int(np.diff(group.offsets).max())
    if prompt + longest > max_len:
        return "too_long", f"prompt {prompt} + completion {longest} tokens > model.max_model_len {max_len}"
    if group.num_tokens == 0:
        return "empty_completion", "every completion of the group is empty: nothing to train on"
    if len(group.reward_components) > MAX_REWARD_COMPONENTS:
        return "too_large", f"{len(group.reward_components)} reward components (at most {MAX_REWARD_COMPONENTS})"
    if any(len(name) > MAX_NAME_CHARS for name in group.reward_components):
        return "too_large", f"a reward component name is longer than {MAX_NAME_CHARS} characters"
    if any(len(reason) > MAX_FINISH_REASON_CHARS for reason in group.finish_reasons):
        return "too_large", f"a finish reason is longer than {MAX_FINISH_REASON_CHARS} characters: shorten it"
    return None


def _token_problem(group: RolloutGroup, vocab_size: int) -> Problem:
    for name in ("prompt_tokens", "completion_tokens"):
        ids = getattr(group, name)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            return "bad_token", f"{name} holds ids in [{low}, {high}], outside the vocabulary [0, {vocab_size})"
    return None


def _value_problem(group: RolloutGroup, max_abs_reward: float) -> Problem:
    components = [(f"reward_components.{name}", values) for name, values in group.reward_components.items()]
    for name, values in [("rewards", group.rewards), *components]:
        if not np.all(np.abs(values) <= max_abs_reward):  # False for NaN too
            return "bad_reward", (
                f"{name} must be finite and within +-{max_abs_reward:g} (buffer.max_abs_reward); "
                f"got {values.tolist()[:8]}"
            )
    logprobs = group.behaviour_logprobs
    if not (logprobs.max() <= 0 and logprobs.min() > -np.inf):  # False for NaN too
        return "bad_logprob", (
            f"behaviour_logprobs must be finite and <= 0 (got [{logprobs.min()}, {logprobs.max()}]): send the "
            "log-probability of each sampled token"
        )
    return None


def _version_problem(group: RolloutGroup, newest_version: int) -> Problem:
    versions = group.versions
    if versions.min() < 0:
        return "bad_version", f"versions must be >= 0 (got min {int(versions.min())})"
    if versions.max() > newest_version:
        return "future_version", (
            f"versions up to {int(versions.max())}, but the learner has published at most {newest_version}"
        )
    token_versions = group.token_versions
    if token_versions.min() < -1:
        return "bad_version", f"token_versions must be >= -1 (-1 on environment tokens; got {token_versions.min()})"
    if token_versions.max() > newest_version:
        return "future_version", (
            f"token_versions up to {int(token_versions.max())}, but the learner has published at most {newest_version}"
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


def journal_record_problem(kind: str, meta: dict[str, Any]) -> Problem:
    """The numbers of a journal record, checked on replay as the wire checks them on decode (`common.types`): every
    integer within +-MAX_COUNT, steps and versions within [0, MAX_VERSION], and the filtered rewards' sum finite
    (a `filtered` record's reward_sum, a `counters` record's no_signal_reward_sum). A journal written before those
    bounds existed may hold a peer's hostile number (a VersionReport's step of 2**63, and the draws it allowed).
    Lease records (grant, expire, requeue, leases) are not checked: later records refer to their leases, and their
    numbers feed no arithmetic or metric."""
    if kind not in _CHECKED_KINDS:
        return None
    if not _integers_within(meta, MAX_COUNT):
        return "bad_number", f"a number beyond +-{MAX_COUNT} in {meta}"[:300]
    for key in _VERSION_KEYS.get(kind, ()):
        if key in meta and not (type(meta[key]) is int and 0 <= meta[key] <= MAX_VERSION):
            return "bad_version", f"{key} {meta[key]!r} is not in [0, {MAX_VERSION}]"
    if kind == "version" and not meta.get("policy_version", 0) <= meta.get("step", 0):
        return "bad_version", f"policy_version {meta['policy_version']} > step {meta['step']}"
    if kind == "draw" and not (meta["world_size"] >= 1 and len(meta["seqs"]) % meta["world_size"] == 0):
        return "bad_draw", f"{len(meta['seqs'])} groups do not split into world_size {meta['world_size']} shares"
    key = _REWARD_SUM_KEYS.get(kind)
    if key in meta and not (type(meta[key]) in (int, float) and math.isfinite(meta[key])):
        return "bad_number", f"{key} {meta[key]!r} is not a finite number"  # it reaches every Batch (wire: finite)
    return None


_CHECKED_KINDS = ("version", "draw", "deliver", "pending_draw", "evict", "drop", "group", "filtered", "counters")
_REWARD_SUM_KEYS = {"filtered": "reward_sum", "counters": "no_signal_reward_sum"}  # floats (dynamic sampling)
_VERSION_KEYS = {
    "version": ("step", "policy_version"),
    "draw": ("step",),
    "deliver": ("step",),
    "pending_draw": ("step",),
}


def _integers_within(value: Any, bound: int) -> bool:
    if type(value) is int:
        return -bound <= value <= bound
    if isinstance(value, dict):
        return all(_integers_within(v, bound) for v in value.values())
    if isinstance(value, list):
        return all(_integers_within(v, bound) for v in value)
    return True
