"""The buffer core's seam for work beside training (buffers/extensions.py) with an extension that is not
evaluation: its place in the lease chain (after the run end, before training admission), its own messages, the
heartbeats, version reports and ticks it hears, its hold on the run's end and the `end_pending` counter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from buffers.core import BufferCore
from buffers.extensions import CoreExtension
from buffers.state import BufferState
from common.types import Heartbeat, LeaseGrant, LeaseRequest, Ok, RunOver, VersionReport
from tests.buffers.fakes import ask, fake_prompts, make_settings


@dataclass(frozen=True)
class Redeem:
    """A message only the extension answers."""

    token: int


class Tokens(CoreExtension):
    """Hands generator 1 a token instead of prompts while it has some; the run's end waits until all are out."""

    def __init__(self, count: int) -> None:
        self.left = count
        self.handlers = {Redeem: self._redeem}
        self.heard_from: list[tuple[int, bool]] = []
        self.versions: list[tuple[int, bool]] = []
        self.ticks: list[list[int]] = []

    def lease_reply(self, request: LeaseRequest, sender: str, now: float) -> Any | None:
        if request.generator_id != 1 or not self.left:
            return None
        self.left -= 1
        return f"token {self.left}"

    def _redeem(self, message: Redeem, reply_to: Any, sender: str, now: float) -> list[tuple[Any, Any]]:
        return [(reply_to, f"redeemed {message.token}")]

    def heard(self, heartbeat: Heartbeat, progressing: bool, now: float) -> None:
        self.heard_from.append((heartbeat.generator_id, progressing))

    def version_reported(self, report: VersionReport, now: float) -> None:
        self.versions.append((report.policy_version, report.final))

    def tick(self, now: float, unresponsive: list[int]) -> None:
        self.ticks.append(sorted(unresponsive))

    def holds_end(self, now: float) -> bool:
        return self.left > 0

    def end_pending(self) -> int:
        return self.left

    def counters(self) -> dict[str, int]:
        return {"tokens_left": self.left}


def test_an_extension_takes_its_place_in_the_chain_and_holds_the_end() -> None:
    tokens = Tokens(2)
    core = BufferCore(BufferState(make_settings(), fake_prompts(40), None), extensions=[tokens])
    assert isinstance(ask(core, LeaseRequest(0, 2, 0), now=0.0), LeaseGrant)  # passed on to training admission
    assert ask(core, LeaseRequest(1, 2, 0), now=0.0) == "token 1"  # answered before admission
    assert ask(core, Redeem(1)) == "redeemed 1"  # its own message, in the core's table
    assert isinstance(ask(core, Heartbeat(1, 0, []), now=0.5), Ok) and tokens.heard_from == [
        (1, True)
    ]  # within the stall timeout: progressing
    assert core.counters()["tokens_left"] == 1 and core.counters()["end_pending"] == 1

    assert isinstance(ask(core, VersionReport(0, 0, final=True), now=1.0), Ok)
    assert tokens.versions == [(0, True)]
    assert ask(core, LeaseRequest(1, 2, 0), now=1.0) == "token 0"  # the end is held: the chain goes on
    assert core.counters()["end_pending"] == 0
    assert ask(core, LeaseRequest(1, 2, 0), now=1.5) == RunOver(step=0)  # no longer held: the run end answers
    assert ask(core, Heartbeat(0, 0, []), now=1.5) == RunOver(step=0)

    core.tick(100.0)  # both generators silent past heartbeat_timeout_s
    assert tokens.ticks == [[0, 1]]


def test_without_extensions_the_core_is_training_alone() -> None:
    core = BufferCore(BufferState(make_settings(), fake_prompts(40), None), extensions=[])
    assert isinstance(ask(core, LeaseRequest(1, 2, 0), now=0.0), LeaseGrant)
    assert core.counters()["end_pending"] == 0
    assert isinstance(ask(core, VersionReport(0, 0, final=True), now=1.0), Ok)
    assert ask(core, LeaseRequest(1, 2, 0), now=1.0) == RunOver(step=0)
