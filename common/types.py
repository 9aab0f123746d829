"""The types that cross process boundaries: defined once, each field saying its shape and alignment.

Every message is a frozen dataclass registered under a wire name (see `common.wire`). Those of evaluation during
training are in `common.eval_messages`, those of a weights update in `common.weight_messages`: `common.wire`
imports both, so every message is registered wherever one is decoded. Token data is columnar:
a `RolloutGroup` holds the `n` completions of one prompt as flat arrays with `offsets`, so that a group of
64 samples travels as a handful of zero-copy frames, not thousands of small objects.

Alignment invariants of a `RolloutGroup` (checked by `validate()`, which `decode` always calls):
  offsets            int64 [n + 1]   offsets[0] = 0, non-decreasing, offsets[n] = N (total completion tokens)
  completion_tokens  int32 [N]       sample i is completion_tokens[offsets[i]:offsets[i + 1]]
  behaviour_logprobs float32 [N]     log-prob of each token under the weights that sampled it; 0 where loss_mask = 0
  loss_mask          uint8 [N]       1 = token sampled by the model (an action), 0 = environment token (multi-turn)
  token_versions     int32 [N]       policy_version of the weights that produced each token (-1 on env tokens)
  versions           int32 [n]       per sample: the oldest policy_version among its tokens; staleness uses it
  rewards            float32 [n]     scalar reward of each sample (the sum of its components)

Bounds checked on decode by `common.field_checks.from_fields` (so that no peer can send a number the system cannot
represent; what a value may be in context, e.g. a version the learner has published, is the receiver's check):
  policy versions and steps  [0, MAX_VERSION]   they travel in int32 arrays, and staleness = step - version is int32
                             (-1 = "none" where a field says so: have_version, latest_version)
  ids, sizes, counts         [0, MAX_COUNT]     exact in float64, so in JSON, TensorBoard and metrics
  any other integer          [-MAX_COUNT, MAX_COUNT]   (list items and map values included)
  every float                finite
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Increase whenever a message's fields change meaning or shape; peers with another version are refused.
PROTOCOL_VERSION = 1

MESSAGE_TYPES: dict[str, type] = {}

MAX_VERSION = 2**31 - 1  # policy versions and learner steps: int32 on the wire (versions, token_versions, staleness)
MAX_COUNT = 2**53 - 1  # ids, sizes and counters: the largest integer a float64 (JSON, TensorBoard) holds exactly


class ContractError(ValueError):
    """A message's fields break the data contract (wrong type, shape, dtype or alignment)."""


def message(name: str):
    """Register a frozen dataclass as a wire message under `name`."""

    def register(cls: type) -> type:
        cls = dataclass(frozen=True)(cls)
        cls.WIRE_NAME = name
        MESSAGE_TYPES[name] = cls
        return cls

    return register


def array(dtype: str, ndim: int = 1) -> Any:
    """A numpy array field of exactly this dtype and number of dimensions."""
    return field(metadata={"dtype": np.dtype(dtype), "ndim": ndim})


def count(low: int = 0, high: int = MAX_COUNT) -> Any:
    """An integer field (or the items of a list of integers) that decodes only within [low, high]."""
    return field(metadata={"low": low, "high": high})


def defaulted(value: Any, low: int = 0, high: int = MAX_COUNT) -> Any:
    """An integer field with a default (older peers may omit it), decoded within [low, high]."""
    return field(default=value, metadata={"low": low, "high": high})


def version(low: int = 0) -> Any:
    """A policy version or learner step: within [low, MAX_VERSION] (low = -1 where -1 means "none")."""
    return count(low, MAX_VERSION)


# ---------------------------------------------------------------------------------------------------- prompts
@message("prompt")
class PromptItem:
    """One prompt of a lease. `messages` is a chat; the generator renders it with the model's chat template."""

    prompt_id: int = count()  # row of the dataset (stable across epochs)
    epoch: int = count()  # pass over the dataset this prompt was drawn in
    messages: list[dict[str, str]]  # [{"role": "user", "content": "..."}]
    metadata: dict[str, Any]  # what the reward needs (e.g. the answer); JSON-like values only


@message("lease_request")
class LeaseRequest:
    """Generator -> buffer: 'give me up to `max_prompts` prompts'; `policy_version` = weights it samples with."""

    generator_id: int = count()
    max_prompts: int = count()
    policy_version: int = version()


@message("lease_grant")
class LeaseGrant:
    """Buffer -> generator. Prompts must come back as groups (one per prompt) before `deadline` (unix time)."""

    lease_id: int = count()
    deadline: float
    prompts: list[PromptItem]


@message("lease_refused")
class LeaseRefused:
    """Buffer -> generator. `reason`: 'stale' (load weights >= `min_version` first), 'full' (admission control:
    wait for the learner), 'exhausted' (every epoch served). The generator waits, it does not spin."""

    reason: str
    min_version: int = version()
    retry_after_s: float


@message("heartbeat")
class Heartbeat:
    """Generator -> buffer, periodically, from a thread of its own (`actors.liveness`): 'I am alive, these leases are
    mine, and this is how far I got'. The buffer renews the listed leases while `progress` moves (buffers.leases)."""

    generator_id: int = count()
    policy_version: int = version()
    lease_ids: list[int] = count()
    # Monotone counter of work done (engine steps that ran a request + samples finished + env calls answered): the buffer
    # takes a generator whose counter stands still for buffer.stall_timeout_s as stuck. 0 from older peers.
    progress: int = defaulted(0)
    # Completion tokens sampled so far, unfinished samples included (one per request an engine step ran): the
    # buffer's generation rate, for the learner's report of a long wait (learners.stall_report). 0 from older peers.
    tokens: int = defaulted(0)
    # The eval lease the generator is sampling (at most one; ids of buffers.evaluation, not of lease_ids): renewed.
    eval_lease_ids: list[int] = field(default_factory=list, metadata={"low": 0, "high": MAX_COUNT})


@message("lease_return")
class LeaseReturn:
    """Generator -> buffer on shutdown: these prompts were not finished; re-issue them."""

    generator_id: int = count()
    lease_id: int = count()
    prompt_ids: list[int] = count()


# ---------------------------------------------------------------------------------------------------- rollouts
@message("group")
class RolloutGroup:
    """The `n` completions of one prompt, columnar (alignment in the module docstring)."""

    lease_id: int = count()
    prompt_id: int = count()
    epoch: int = count()
    generator_id: int = count()
    prompt_tokens: np.ndarray = array("int32")  # [P]
    offsets: np.ndarray = array("int64")  # [n + 1]
    completion_tokens: np.ndarray = array("int32")  # [N]
    behaviour_logprobs: np.ndarray = array("float32")  # [N]
    loss_mask: np.ndarray = array("uint8")  # [N]
    token_versions: np.ndarray = array("int32")  # [N]
    versions: np.ndarray = array("int32")  # [n] oldest policy_version behind each sample (staleness is judged by it)
    rewards: np.ndarray = array("float32")  # [n]
    reward_components: dict[str, np.ndarray] = field(default_factory=dict)  # name -> float32 [n]
    finish_reasons: list[str] = field(default_factory=list)  # [n]: "stop", "length", "error: ...", env reasons
    started_at: float = 0.0  # unix time the first sample was submitted to the engine
    finished_at: float = 0.0  # unix time the last sample finished

    @property
    def group_id(self) -> tuple[int, int]:
        """(lease_id, prompt_id): unique per lease; used to de-duplicate a re-sent or re-issued group."""
        return (self.lease_id, self.prompt_id)

    @property
    def size(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def min_version(self) -> int:
        """The oldest policy_version that produced any token of this group."""
        return int(self.versions.min())

    def validate(self) -> None:
        """Alignment (module docstring), finite rewards and log-probs. What the values may be (token ids in the
        vocabulary, bounded rewards, lengths within model.max_model_len) is the buffer's check: `buffers.checks`."""
        n = self.size
        if n < 1:
            raise ContractError("group: offsets must hold n + 1 >= 2 entries")
        if self.offsets[0] != 0 or np.any(np.diff(self.offsets) < 0):
            raise ContractError("group.offsets: must start at 0 and never decrease")
        total = int(self.offsets[-1])
        for name in ("completion_tokens", "behaviour_logprobs", "loss_mask", "token_versions"):
            if len(getattr(self, name)) != total:
                raise ContractError(f"group.{name}: length {len(getattr(self, name))} != offsets[-1] = {total}")
        if len(self.rewards) != n or len(self.versions) != n or len(self.finish_reasons) != n:
            raise ContractError(f"group: rewards, versions and finish_reasons must have n = {n} entries")
        for name, values in self.reward_components.items():
            if not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.shape != (n,):
                raise ContractError(f"group.reward_components.{name}: must be float32 [{n}]")
        if np.any(self.loss_mask > 1):
            raise ContractError("group.loss_mask: values must be 0 or 1")
        if not (np.all(np.isfinite(self.rewards)) and np.all(np.isfinite(self.behaviour_logprobs))):
            raise ContractError("group: rewards and behaviour_logprobs must be finite")


# What one group may hold besides its token arrays (the buffer rejects more: memory per group stays bounded).
MAX_REWARD_COMPONENTS = 64
MAX_NAME_CHARS = 128  # a reward component's name
MAX_FINISH_REASON_CHARS = 1024  # generators cut their error reasons at 300-500 characters
# Bytes per completion token (completion_tokens int32, behaviour_logprobs float32, loss_mask uint8, token_versions
# int32), per sample (offsets int64, versions int32, rewards float32) and per sample and reward component (float32).
TOKEN_BYTES, SAMPLE_BYTES, COMPONENT_BYTES = 13, 16, 4


def max_group_bytes(group_size: int, max_model_len: int) -> int:
    """The most a group the buffer accepts can hold: `group_size` samples of prompt + completion <= max_model_len
    tokens (int32 prompt tokens, TOKEN_BYTES a completion token), every reward component and finish reason at
    its longest (4 bytes a character, UTF-8's worst), plus 8 bytes of offsets[0]."""
    components = MAX_REWARD_COMPONENTS * (group_size * COMPONENT_BYTES + 4 * MAX_NAME_CHARS)
    return (
        4 * max_model_len
        + group_size * (max_model_len * TOKEN_BYTES + SAMPLE_BYTES + 4 * MAX_FINISH_REASON_CHARS)
        + components
        + 8
    )


@message("group_ack")
class GroupAck:
    """Buffer -> generator. status: 'accepted', 'duplicate' (already have it: fine) or 'rejected' (+ reason)."""

    lease_id: int = count()
    prompt_id: int = count()
    status: str
    reason: str = ""


# ---------------------------------------------------------------------------------------------------- learners
@message("batch_request")
class BatchRequest:
    """Learner rank -> buffer: its share of the global batch for `step` (the learner's policy_version)."""

    step: int = version()
    rank: int = count()
    world_size: int = count()
    num_groups: int = count()  # groups in the GLOBAL batch; each rank gets num_groups / world_size
    timeout_s: float  # how long the buffer may hold the request before answering `BatchNotReady`


@message("batch")
class Batch:
    """Buffer -> learner rank: whole groups, with per-sample staleness at the step they were drawn for."""

    step: int = version()
    rank: int = count()
    groups: list[RolloutGroup]
    staleness: list[np.ndarray]  # per group: int32 [n] = step - group.versions
    dropped_stale: int = count()  # samples dropped as too stale so far (cumulative counter of the buffer)
    # Dynamic sampling (buffer.filter = "no_signal"), cumulative like dropped_stale: samples filtered at arrival so
    # far, and the float64 sum of their rewards (finite, as every float on the wire; rewards may be negative). With
    # the learner's own reward/mean they give the mean reward of every generated sample (benchmarks.time_to_reward).
    # Defaults: a buffer from before them omits them (0: nothing filtered).
    dropped_no_signal: int = defaulted(0)
    no_signal_reward_sum: float = 0.0


@message("batch_not_ready")
class BatchNotReady:
    """Buffer -> learner: no batch within the timeout; ask again. `buffered` = complete groups held now."""

    step: int = version()
    buffered: int = count()


@message("version_report")
class VersionReport:
    """Learner (rank 0) -> buffer: weights of `policy_version` are published; `step` optimizer steps taken.

    A plain report only moves forward, to at most the step after the last batch the buffer drew. `resync` marks
    the learner's own announcement (at its start or resume, or after the buffer refused it): it may move back
    to an older checkpoint's step, and forward only on a buffer that has no learner history yet. `final` marks
    the report of the learner's last step (see `RunOver`); a later announcement without it reopens the run."""

    policy_version: int = version()
    step: int = version()
    resync: bool = False
    final: bool = False  # the learner reached learner.total_steps: the run is over (the buffer tells the generators)


@message("run_over")
class RunOver:
    """Buffer -> generator, the reply to a lease request or a heartbeat once the learner's final report came: the
    run is over at learner step `step`. The generator stops sampling, delivers the groups it built, returns its
    other prompts (LeaseReturn) and exits 0; the buffer exits once every live generator has heard it."""

    step: int = version()


@message("ok")
class Ok:
    """Generic acknowledgement, with the buffer's view of the learner's version."""

    learner_version: int = version()


@message("error")
class ErrorReply:
    """Any service -> sender: your message was rejected, and why. The service stays up."""

    reason: str
    kind: str = ""  # the short key it was counted under (`rejected_<kind>`), for a peer that reacts by kind


@message("stats_request")
class StatsRequest:
    """Anyone -> buffer: send the accounting counters (for tests, metrics and the launcher)."""


@message("stats")
class BufferStats:
    """The buffer's accounting (`buffers.accounting`), in samples and in groups (`<key>_groups`):
    arrived = trained + dropped_stale + dropped_no_signal + evicted + rejected + buffered."""

    counters: dict[str, int]
    learner_version: int = version()


# ---------------------------------------------------------------------------------------------------- rewards
MAX_REWARD_GROUP = 4096  # completions in one reward request (algo.group_size is far below)
MAX_REWARD_TEXT_CHARS = 1 << 20  # one message's content or one completion (common.sockets bounds the whole message)


@message("reward_request")
class RewardRequest:
    """Generator (or `tandem eval`) -> reward service: score the n completions of one prompt, a whole group.
    Each completion is appended to `prompt` as an assistant turn and the chat scored (actors/rewards/model.py)."""

    request_id: int = count()  # the sender's own id, echoed in the reply (a late reply to an abandoned one is dropped)
    prompt: list[dict[str, str]]  # the prompt's messages: [{"role": "user", "content": "..."}, ...]
    completions: list[str]  # [n], n >= 1

    def validate(self) -> None:
        if not 1 <= len(self.completions) <= MAX_REWARD_GROUP:
            raise ContractError(f"reward_request.completions: {len(self.completions)} (1 to {MAX_REWARD_GROUP})")
        if not self.prompt:
            raise ContractError("reward_request.prompt: no messages")
        for i, turn in enumerate(self.prompt):
            if not {"role", "content"} <= turn.keys():
                raise ContractError(f"reward_request.prompt[{i}]: needs 'role' and 'content', has {sorted(turn)}")
        texts = [*self.completions, *(value for turn in self.prompt for value in turn.values())]
        if any(len(text) > MAX_REWARD_TEXT_CHARS for text in texts):
            raise ContractError(f"reward_request: a text longer than {MAX_REWARD_TEXT_CHARS} characters")


@message("reward_reply")
class RewardReply:
    """Reward service -> sender: one score per completion of request `request_id`, in order; or no scores and
    `error` saying why the group could not be scored (the sender falls back, counts and logs it)."""

    request_id: int = count()
    scores: list[float]  # [n] raw (or normalised, reward.normalize) reward-model scores; [] with an error
    error: str = ""

    def validate(self) -> None:
        if bool(self.scores) == bool(self.error):
            raise ContractError("reward_reply: exactly one of scores or error")
