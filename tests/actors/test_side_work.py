"""The generator's seam for side work (actors/side_work.py) with a piece of work that is not evaluation: whatever
implements the seam is offered the lease replies the rollouts do not take, gets its own finished samples, holds
weight loads, keeps the generator from exiting and reports, without a line of the generator naming it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from actors.engine.api import FinishedSample
from common.metrics import read_metrics
from tests.actors.test_generator_eval import FakeLink, TextEngine, _pass, closing, make_generator, training_grant

__all__ = ["closing"]  # the fixture, used by name below


@dataclass
class Ping:
    """A lease reply only the side work knows (as an eval grant is evaluation's)."""

    lease_id: int = 5
    needs_version: int = 3


class Echo:
    """Side work that samples one request per `Ping` it takes and records what the generator asks of it."""

    def __init__(self, engine: TextEngine) -> None:
        self.engine = engine
        self.taken: list[Ping] = []
        self.samples: list[FinishedSample] = []
        self.queued = 0
        self.hold = False
        self.loads = 0
        self.dropped: list[str] = []

    def takes(self, reply: Any) -> bool:
        return isinstance(reply, Ping)

    def take(self, reply: Ping) -> int | None:
        self.taken.append(reply)
        self.queued += 1
        return reply.needs_version

    def lease_ids(self) -> list[int]:
        return [ping.lease_id for ping in self.taken[len(self.samples) :]]

    def holds_weights(self) -> bool:
        return self.hold

    def before_load(self) -> None:
        self.loads += 1

    def submit(self) -> int:
        added, self.queued = self.queued, 0
        for i in range(added):
            self.engine.add(f"echo-{len(self.taken)}-{i}", list(b"t=1"), max_tokens=4)
        return added

    def owns(self, request_id: str) -> bool:
        return request_id.startswith("echo-")

    def on_sample(self, sample: FinishedSample) -> None:
        self.samples.append(sample)

    def deliver(self, link: Any) -> int:
        return 0

    def keeps_running(self, link_up: bool) -> bool:
        return len(self.samples) < len(self.taken)

    def drop(self, why: str) -> None:
        self.dropped.append(why)

    def metrics(self) -> dict[str, float]:
        return {"actor/echo_samples": float(len(self.samples))}


def test_side_work_gets_its_replies_and_samples_and_training_goes_on(tmp_path, closing) -> None:
    engine = TextEngine()
    link = FakeLink([Ping(), training_grant(1, [0])])
    actor = make_generator(tmp_path, engine, link, evaluate=False)
    closing(actor)
    echo = Echo(engine)
    actor.side = [echo]
    for _ in range(200):
        _pass(actor)
        if echo.samples and len(actor.outbox.acks):
            break
    assert echo.taken == [Ping()] and actor.weights.wanted[0] == 3  # the version it needs is asked for first
    assert [s.request_id for s in echo.samples] == ["echo-1-0"]  # its own sample, routed by request id
    assert len(actor.outbox.acks) == 1  # the training group was built and pushed as without side work
    actor.report(0.0, force=True)
    (record,) = read_metrics(actor.metrics.jsonl_path)[-1:]
    assert record["actor/echo_samples"] == 1.0


def test_side_work_holds_loads_and_the_exit(tmp_path, closing) -> None:
    engine = TextEngine()
    actor = make_generator(tmp_path, engine, FakeLink([]), evaluate=False, inflight_weight_update=True)
    closing(actor)
    echo = Echo(engine)
    actor.side = [echo]
    echo.take(Ping())
    assert echo.submit() == 1 and engine.num_unfinished() == 1  # its request runs
    echo.hold = True
    actor.weights.offer(1)
    actor.update_weights(0.0)
    assert engine.policy_version == 0 and echo.loads == 0  # in-flight mode, held while it says so
    echo.hold = False
    actor.update_weights(0.0)
    assert engine.policy_version == 1 and echo.loads == 1  # told just before the load
    actor.exhausted = True
    actor.link.up = True  # the buffer answers (FakeLink has no connection state of its own)
    assert not actor.done()  # its sample has not come back: the generator must not exit
    echo.samples.append(None)  # type: ignore[arg-type]
    assert actor.done()
    actor.begin_drain(0.0, "SIGTERM")
    assert echo.dropped == ["SIGTERM"]
