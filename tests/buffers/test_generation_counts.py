"""What the buffer tells a learner that waits long for a batch (`learners.stall_report`): tokens the generators
report sampling (from heartbeats, monotone across a generator's restart), tokens of the groups that arrived, and the
generators alive now; in the StatsRequest answer and the buffer's metrics, never in the journalled ledger."""

from __future__ import annotations

from buffers.traffic import Traffic
from common.types import BufferStats, Heartbeat, LeaseGrant, LeaseRequest, StatsRequest
from tests.buffers.fakes import GROUP, ask, make_core, make_group


def test_tokens_sampled_never_go_back_when_a_generator_restarts() -> None:
    traffic = Traffic()
    traffic.heard(0, 100)
    traffic.heard(1, 40)
    traffic.heard(0, 250)
    assert traffic.tokens_sampled == 290
    traffic.heard(0, 10)  # generator 0 restarted: counts from 0 again
    assert traffic.tokens_sampled == 250 + 40 + 10


def test_stats_carry_tokens_and_generators_alive_but_the_ledger_does_not() -> None:
    core = make_core()
    timeout = core.state.dispenser.heartbeat_timeout_s
    assert ask(core, StatsRequest()).counters["generators_alive"] == 0
    grant = ask(core, LeaseRequest(0, 1, 0), now=1.0)
    assert isinstance(grant, LeaseGrant)
    ask(core, Heartbeat(0, 0, [grant.lease_id], progress=3, tokens=96), now=2.0)
    ask(core, make_group(grant.lease_id, grant.prompts[0], 0, GROUP), now=3.0)
    stats = ask(core, StatsRequest(), now=3.0)
    assert isinstance(stats, BufferStats)
    completion = stats.counters["tokens_arrived"]
    assert completion > 0 and stats.counters["tokens_sampled"] == 96 and stats.counters["generators_alive"] == 1
    assert "tokens_sampled" not in core.counters()  # a restarted buffer's ledger compares equal to the old one's
    assert core.metrics()["buffer/tokens_arrived"] == completion
    assert ask(core, StatsRequest(), now=3.0 + timeout + 1).counters["generators_alive"] == 0
