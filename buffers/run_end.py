"""The end of a run, as the buffer sees it: the learner's final report, the generators told, and when to exit.

    end = RunEnd()
    end.close(step)                          # the learner reported its last step (VersionReport.final)
    reply = end.tell(generator_id)           # RunOver(step): the answer to that generator's lease or heartbeat
    end.reopen()                             # a learner announced itself again without `final` (a longer resume)
    if end.everyone_told(dispenser, now): ...   # the service loop exits 0

Only the learner knows `learner.total_steps` (its own overrides may differ from the buffer's config), so the run
is over when it says so, in the report of its last published version. Generators hear it in the reply to their
next lease request or heartbeat (every few seconds), then deliver what they built, return the rest and exit.

The buffer waits for every generator that is alive (heard from within `buffer.heartbeat_timeout_s`) to have been
told and to hold no active lease (its groups came back or it returned them). A generator that is dead or silent
drops out of that set after `heartbeat_timeout_s`, so the wait is bounded by it; a generator that first connects
after the buffer exited is not waited for (it finds no buffer). The state is not journaled: a restarted buffer
knows no end until the learner reports one again.
"""

from __future__ import annotations

import logging
from typing import Protocol

from common.types import RunOver

log = logging.getLogger("tandem.buffer")


class LeaseHolders(Protocol):
    """What `everyone_told` reads from `buffers.leases.PromptDispenser`."""

    last_seen: dict[int, float]

    def dead_generators(self, now: float) -> list[int]: ...

    def holders(self) -> set[int]: ...


class RunEnd:
    """Whether the run is over, and which generators have been told. Not thread-safe (the service loop owns it)."""

    def __init__(self) -> None:
        self.step: int | None = None  # the learner's last step, once reported
        self.told: set[int] = set()

    @property
    def over(self) -> bool:
        return self.step is not None

    def close(self, step: int) -> None:
        if self.step is None:
            log.info("the learner reached its last step %d: the run is over; telling the generators", step)
        self.step = step

    def reopen(self) -> None:
        if self.step is not None:
            log.info("a learner announced itself after the run's end at step %d: the run goes on", self.step)
        self.step, self.told = None, set()

    def tell(self, generator_id: int) -> RunOver:
        """The reply that ends this generator (only while `over`)."""
        if generator_id not in self.told:
            log.info("generator %d told the run is over", generator_id)
        self.told.add(generator_id)
        return RunOver(step=self.step or 0)

    def everyone_told(self, dispenser: LeaseHolders, now: float) -> bool:
        """Over, and every live generator was told and holds no active lease (see the module docstring)."""
        if self.step is None:
            return False
        alive = set(dispenser.last_seen) - set(dispenser.dead_generators(now))
        return alive <= self.told and not (alive & dispenser.holders())
