"""Who may send what to the buffer, and which learner state changes are in order.

    role_problem(type(message), request.role)              # only learner ranks draw batches and report versions
    version_order_problem(report, learner_version, policy_version, drawn_high)
    draw_problem(request, draw_floor, batch_shape)         # a NEW draw only: re-serving a drawn batch is always fine
    heartbeat_lease_problem(heartbeat, lease_owner)

Each returns None when acceptable, else (kind, reason) like `buffers.checks`: the core raises it as
`RequestRejected` before anything is committed, so a refused message is counted (`rejected_<kind>`) and answered
with an `ErrorReply`, and never reaches the journal (a restart does not replay it).

The learner's timeline, as the buffer holds it (`BufferState`): `learner_version` (V, the step of the last
accepted report), `draw_floor` (F, the lowest step a new batch may be drawn for: one past the last draw, or the
step a learner re-announced), `drawn_high` (H, one past the highest step ever drawn; never lowered) and
`batch_shape` (world_size, num_groups of the last draw). The rules:
- no report goes past max(V, H): the learner reports step s after training the batch of s - 1, so a later step
  was never served, and claiming it is a spoof (it would drop every buffered group as stale and refuse every
  generator). Only a `resync` on a buffer with no learner history (V = H = 0: e.g. one restarted without its
  journal) may go further;
- a plain VersionReport moves forward only: step >= V, and its policy_version does not go back;
- a `resync` report is the learner announcing itself (start, resume from an older checkpoint, after a refusal):
  it may go back (the buffer re-bases admission) and sets F to its step;
- a new draw is for a step >= F (an older step was drawn already: drawing it again would hand fresh groups to
  the caller), and of the last draw's shape unless a resync came since (a conflicting world_size would make the
  learner's own request conflict with the step's draw forever).
Trust: the role is proven by the CURVE key (or declared, on loopback without keys: see `common.sockets`); peers
of one role are not told apart (every generator holds the generator key), so these rules stop a confused or
foreign peer, not a hostile one that holds the learner's key.
"""

from __future__ import annotations

from collections.abc import Mapping

from common.eval_messages import EvalResult
from common.types import BatchRequest, Heartbeat, LeaseRequest, LeaseReturn, RolloutGroup, StatsRequest, VersionReport

Problem = tuple[str, str] | None
ANY_ROLE = frozenset({"generator", "learner", "reward", "eval", "monitor"})
PERMITTED: dict[type, frozenset[str]] = {
    LeaseRequest: frozenset({"generator"}),
    RolloutGroup: frozenset({"generator"}),
    Heartbeat: frozenset({"generator"}),
    LeaseReturn: frozenset({"generator"}),
    EvalResult: frozenset({"generator"}),  # an eval lease's result (buffers.evaluation)
    BatchRequest: frozenset({"learner"}),
    VersionReport: frozenset({"learner"}),
    StatsRequest: ANY_ROLE | {""},  # counters only: also a client without a role (loopback only)
}


def role_problem(message_type: type, role: str) -> Problem:
    """May a peer of `role` ("" = none) send this message type? Unknown types are the core's to refuse."""
    allowed = PERMITTED.get(message_type)
    if allowed is None or role in allowed:
        return None
    name = getattr(message_type, "WIRE_NAME", message_type.__name__)
    return "forbidden_role", (
        f"a peer of role '{role or 'none'}' may not send '{name}' (only {', '.join(sorted(r or 'none' for r in allowed))}"
        "): connect with that role's key (tandem keys), or without keys declare the role (Client role=...)"
    )


def version_order_problem(report: VersionReport, learner_version: int, policy_version: int, drawn_high: int) -> Problem:
    """Is `report` in order with the buffer's timeline (see the module docstring)?"""
    ceiling = max(learner_version, drawn_high)
    fresh = learner_version == 0 and drawn_high == 0
    if report.step > ceiling and not (report.resync and fresh):
        return "version_jump", (
            f"step {report.step} is beyond step {ceiling}, the most the buffer's draws allow (batches were drawn up to "
            f"step {drawn_high - 1}): report a step only after training the batch before it"
        )
    if report.resync:
        return None
    if report.step < learner_version:
        return "version_backwards", (
            f"step {report.step} < {learner_version}, the step already reported: a learner that resumed from an "
            "older checkpoint announces it with resync = true"
        )
    if report.policy_version < policy_version:
        return "version_backwards", (
            f"policy_version {report.policy_version} < {policy_version}, the version already reported (resync = "
            "true announces a restarted learner)"
        )
    return None


def draw_problem(request: BatchRequest, draw_floor: int, batch_shape: tuple[int, int] | None) -> Problem:
    """May the batch of `request.step` be drawn now (no batch of that step is drawn or kept)?"""
    if request.step < draw_floor:
        return "old_step", (
            f"step {request.step} was drawn already and is not kept (new batches start at step {draw_floor}): a "
            "learner that resumed from an older checkpoint announces its step first (VersionReport resync = true)"
        )
    if batch_shape is not None and (request.world_size, request.num_groups) != batch_shape:
        return "batch_shape", (
            f"world_size {request.world_size} and num_groups {request.num_groups} differ from the last draw's "
            f"{batch_shape[0]} and {batch_shape[1]}: every step of one learner run uses the same values (a learner "
            "restarted with others announces itself first: VersionReport resync = true)"
        )
    return None


def heartbeat_lease_problem(heartbeat: Heartbeat, lease_owner: Mapping[int, int]) -> Problem:
    """`lease_owner`: lease id -> generator id of the leases the buffer knows; unknown (forgotten) ids pass."""
    foreign = [i for i in heartbeat.lease_ids if lease_owner.get(i, heartbeat.generator_id) != heartbeat.generator_id]
    if foreign:
        return "wrong_generator", (
            f"leases {foreign[:8]} belong to other generators, not to generator {heartbeat.generator_id}: a "
            "heartbeat lists only the sender's own leases"
        )
    return None
