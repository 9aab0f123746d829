"""The generator's seam for optional work that shares its engine with the rollouts: evaluation today.

The generator (`actors.generator`) holds its rollouts (training samples, `actors.rollouts`) and a list of such
side work; with none configured the list is empty and the loop is the rollouts' alone. Each phase of the loop
asks every piece the same questions, so no phase names a feature:

    lease reply   a reply to a lease request that is not the rollouts' (a grant, a refusal, RunOver) is offered
                  to each piece: `takes(reply)` says whose it is, `take(reply)` takes it and names the policy
                  version it needs (the generator asks the publisher for it)
    heartbeat     `lease_ids()`: leases it holds, which the heartbeats renew at the buffer
    weights       `holds_weights()`: the next load waits (in-flight mode) until this is False;
                  `before_load()`: called just before a load, to abort or redo what must not mix versions
    submit        `submit()`: add its engine requests, before the leased prompts (the generator calls it only
                  when adding requests is allowed: not while a default-mode load waits for the engine to drain)
    engine step   `owns(request_id)`: a finished sample is routed to the piece that owns its request id, else
                  to the rollouts; `on_sample(sample)` takes it
    push          `deliver(link)`: send finished results to the buffer (kept while it is away)
    exit          `keeps_running(link_up)`: work the generator must not exit before (exhausted or not);
                  `drop(why)`: give up what is held (draining, RunOver, exit)
    report        `metrics()`: `actor/...` values for the generator's report
`actors.evaluation.Evaluator` is the one implementation; a new optional job of the generator (say, an adapter
that samples for another run) goes beside it, not into the loop.
"""

from __future__ import annotations

from typing import Any, Protocol

from actors.engine.api import FinishedSample
from actors.outbox import BufferLink


class SideWork(Protocol):
    """See the module docstring. One thread: the generator's."""

    def takes(self, reply: Any) -> bool: ...

    def take(self, reply: Any) -> int | None: ...

    def lease_ids(self) -> list[int]: ...

    def holds_weights(self) -> bool: ...

    def before_load(self) -> None: ...

    def submit(self) -> int: ...

    def owns(self, request_id: str) -> bool: ...

    def on_sample(self, sample: FinishedSample) -> None: ...

    def deliver(self, link: BufferLink) -> int: ...

    def keeps_running(self, link_up: bool) -> bool: ...

    def drop(self, why: str) -> None: ...

    def metrics(self) -> dict[str, float]: ...
