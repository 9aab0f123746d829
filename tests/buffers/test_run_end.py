"""The end of a run in the buffer (no sockets): after the learner's final report, lease requests and heartbeats are
answered RunOver, and the buffer is done once every live generator heard it and holds no lease; a silent one stops
counting after heartbeat_timeout_s; a learner that announces itself again without `final` reopens the run."""

from __future__ import annotations

from common.types import Heartbeat, LeaseGrant, LeaseRequest, LeaseReturn, Ok, RunOver, VersionReport
from tests.buffers.fakes import ask, make_core

HEARTBEAT_TIMEOUT_S = 3.0  # make_settings' default


def test_generators_are_told_and_the_buffer_ends_once_each_returned_its_lease() -> None:
    core = make_core()
    grant = ask(core, LeaseRequest(0, 2, 0), now=0.0)
    assert isinstance(grant, LeaseGrant)
    assert isinstance(ask(core, Heartbeat(1, 0, []), now=0.0), Ok)  # generator 1: alive, holds nothing
    assert not core.run_over(0.0)

    assert isinstance(ask(core, VersionReport(0, 0, final=True), now=1.0), Ok)
    assert not core.run_over(1.0)  # nobody has heard it yet
    assert ask(core, Heartbeat(0, 0, [grant.lease_id]), now=1.0) == RunOver(step=0)
    assert not core.run_over(1.0)  # generator 0 still holds its lease; generator 1 was not told
    assert ask(core, LeaseRequest(1, 4, 0), now=1.5) == RunOver(step=0)
    assert not core.run_over(1.5)
    returned = LeaseReturn(0, grant.lease_id, [p.prompt_id for p in grant.prompts])
    assert isinstance(ask(core, returned, now=2.0), Ok)
    assert core.run_over(2.0)


def test_a_silent_generator_is_not_waited_for_past_the_heartbeat_timeout() -> None:
    core = make_core()
    grant = ask(core, LeaseRequest(0, 2, 0), now=0.0)
    assert isinstance(grant, LeaseGrant)
    ask(core, VersionReport(0, 0, final=True), now=0.5)
    assert not core.run_over(0.5 + HEARTBEAT_TIMEOUT_S - 1)
    assert core.run_over(0.5 + HEARTBEAT_TIMEOUT_S + 1)  # dead: its lease is re-issued to nobody


def test_an_announcement_without_final_reopens_the_run() -> None:
    core = make_core()
    ask(core, VersionReport(0, 0, final=True))
    assert ask(core, LeaseRequest(0, 1, 0)) == RunOver(step=0)
    ask(core, VersionReport(0, 0, resync=True))  # a learner resumed with more total_steps
    assert isinstance(ask(core, LeaseRequest(0, 1, 0)), LeaseGrant)
    assert not core.run_over(0.0)
