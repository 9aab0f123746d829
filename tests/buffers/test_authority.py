"""Who may send what to the buffer, and the order of the learner's state changes (buffers.authority): each refusal
raises before anything is committed (the journal does not grow), and a restarted buffer enforces the same."""

from __future__ import annotations

from pathlib import Path

import pytest

from buffers.authority import PERMITTED, draw_problem, role_problem, version_order_problem
from buffers.core import BufferCore, RequestRejected
from buffers.journal import Journal
from common.keys import ROLES
from common.types import Batch, BatchRequest, Heartbeat, LeaseRequest, Ok, StatsRequest, VersionReport
from tests.buffers.fakes import GROUP, ask, make_core, make_group


def test_only_the_permitted_roles_may_send_each_message() -> None:
    for message_type, allowed in PERMITTED.items():
        for role in (*ROLES, ""):
            problem = role_problem(message_type, role)
            assert (problem is None) == (role in allowed), (message_type, role)
    assert role_problem(BatchRequest, "generator")[0] == "forbidden_role"
    assert "only learner" in role_problem(VersionReport, "")[1]
    core = make_core()
    with pytest.raises(RequestRejected, match="role 'generator' may not send 'version_report'"):
        core.handle(VersionReport(1, 1), "me", "test", 0.0, role="generator")
    assert core.handle(StatsRequest(), "me", "test", 0.0, role="")[0][1].learner_version == 0


@pytest.mark.parametrize(
    ("report", "state", "kind"),
    [
        (VersionReport(3, 3), (3, 3, 4), None),  # the same step again: in order
        (VersionReport(4, 4), (3, 3, 4), None),  # after the draw of step 3
        (VersionReport(5, 5), (3, 3, 4), "version_jump"),  # never drawn
        (VersionReport(5, 5, resync=True), (3, 3, 4), "version_jump"),  # not even announced, on a buffer with history
        (VersionReport(2**31 - 1, 2**31 - 1, resync=True), (0, 0, 0), None),  # a buffer with no learner history
        (VersionReport(0, 0), (3, 3, 4), "version_backwards"),
        (VersionReport(2, 3), (3, 3, 4), "version_backwards"),  # policy_version back
        (VersionReport(0, 0, resync=True), (3, 3, 4), None),  # a resumed learner announces an older step
    ],
)
def test_version_reports_move_forward_within_the_draws_unless_announced(report, state, kind) -> None:
    problem = version_order_problem(report, *state)
    assert (problem and problem[0]) == kind or problem is None and kind is None, problem


def test_new_draws_are_for_new_steps_of_the_same_shape() -> None:
    assert draw_problem(BatchRequest(4, 0, 1, 2, 0.0), 4, (1, 2)) is None
    assert draw_problem(BatchRequest(3, 0, 1, 2, 0.0), 4, (1, 2))[0] == "old_step"
    assert draw_problem(BatchRequest(4, 1, 2, 2, 0.0), 4, (1, 2))[0] == "batch_shape"
    assert draw_problem(BatchRequest(4, 1, 2, 2, 0.0), 4, None) is None  # after a resync: any shape


def _feed(core: BufferCore, version: int, count: int = 2) -> None:
    grant = ask(core, LeaseRequest(0, count, version))
    for prompt in grant.prompts:
        assert ask(core, make_group(grant.lease_id, prompt, 0, GROUP, version)).status == "accepted"


def test_refusals_are_not_journaled_and_a_restarted_buffer_keeps_the_timeline(tmp_path: Path) -> None:
    path = tmp_path / "journal.bin"
    core = make_core(journal=Journal(path))
    core.state.restore(0.0)
    for step in range(3):
        _feed(core, step)
        assert isinstance(ask(core, BatchRequest(step, 0, 1, 2, 0.0)), Batch)
        assert isinstance(ask(core, VersionReport(step + 1, step + 1)), Ok)
    _feed(core, 3)
    size = path.stat().st_size
    attacks = [
        (VersionReport(0, 0), "version_backwards"),
        (VersionReport(0, 2**31 - 1), "version_jump"),
        (BatchRequest(1, 0, 1, 2, 0.0), "old_step"),
        (BatchRequest(3, 1, 2, 2, 0.0), "batch_shape"),
    ]
    for message, kind in attacks:
        with pytest.raises(RequestRejected) as refusal:
            core.handle(message, "me", "attacker", 0.0, role="learner")
        assert refusal.value.kind == kind
    with pytest.raises(RequestRejected, match="belong to other generators"):
        core.handle(Heartbeat(7, 0, list(core.state.dispenser.leases)), "me", "attacker", 0.0, role="generator")
    assert path.stat().st_size == size  # nothing of them reached the journal
    core.state.journal.close()

    restarted = make_core(journal=Journal(path))
    restarted.state.restore(0.0)
    state = restarted.state
    assert (state.learner_version, state.draw_floor, state.drawn_high, state.batch_shape) == (3, 3, 3, (1, 2))
    for message, kind in attacks:
        with pytest.raises(RequestRejected) as refusal:
            restarted.handle(message, "me", "attacker", 0.0, role="learner")
        assert refusal.value.kind == kind
    assert isinstance(ask(restarted, BatchRequest(3, 0, 1, 2, 0.0)), Batch)  # the learner carries on
    restarted.state.compact(0.0)
    restarted.state.journal.close()
    compacted = make_core(journal=Journal(path))
    compacted.state.restore(0.0)
    state = compacted.state
    assert (state.draw_floor, state.drawn_high, state.batch_shape) == (4, 4, (1, 2))
    assert isinstance(ask(compacted, VersionReport(1, 1, resync=True)), Ok)  # a resume from step 1's checkpoint
    assert (compacted.state.draw_floor, compacted.state.batch_shape) == (1, None)
    compacted.state.journal.close()
