"""Global batches drawn once per learner step, split into equal shares by rank, and the requests held for them.

    book.add(DrawnBatch.split(step, world_size, seqs, groups))    # the global batch of `step`, drawn once
    groups, staleness = book.find(step).share(rank)                # the same share however often a rank asks
    book.deliver(step, rank)                                       # forgotten once every rank got its share

Ordering: shares are contiguous slices of the drawn order (rank r gets groups [r·k, (r+1)·k), k = num_groups /
world_size). A batch every rank received moves to `completed` and stays there (for a rank whose reply was
lost and asks again) until another batch completes. Requests that cannot be answered yet are held, one per
(step, rank, sender connection) (a retry on the same connection replaces the older one; a request from another
connection never displaces it, so no peer can take a held learner request's batch), until they can be served or
their deadline passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from buffers.staleness import sample_staleness
from common.types import BatchRequest, RolloutGroup


@dataclass
class DrawnBatch:
    """The global batch of one step: groups in drawn order with their staleness at that step."""

    step: int
    world_size: int
    seqs: list[int]
    groups: list[RolloutGroup]
    staleness: list[np.ndarray]  # per group: int32 [n] = step - group.versions
    delivered: set[int] = field(default_factory=set)

    @classmethod
    def split(cls, step: int, world_size: int, seqs: list[int], groups: list[RolloutGroup]) -> DrawnBatch:
        if len(groups) % world_size:
            raise ValueError(f"{len(groups)} groups do not split into {world_size} equal shares")
        return cls(step, world_size, seqs, groups, [sample_staleness(step, g.versions) for g in groups])

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def share(self, rank: int) -> tuple[list[RolloutGroup], list[np.ndarray]]:
        per_rank = self.num_groups // self.world_size
        window = slice(rank * per_rank, (rank + 1) * per_rank)
        return self.groups[window], self.staleness[window]


@dataclass
class HeldRequest:
    """A BatchRequest waiting for enough groups; answered BatchNotReady at `deadline` (unix time)."""

    reply_to: Any
    request: BatchRequest
    deadline: float
    sender: str = ""  # the connection it came on (`common.sockets.Request.sender`)


class BatchBook:
    """Drawn batches by step, the last completed one, and held requests. Not thread-safe."""

    def __init__(self) -> None:
        self.drawn: dict[int, DrawnBatch] = {}
        self.completed: DrawnBatch | None = None
        self.held: dict[tuple[int, int, str], HeldRequest] = {}

    def find(self, step: int) -> DrawnBatch | None:
        if step in self.drawn:
            return self.drawn[step]
        if self.completed is not None and self.completed.step == step:
            return self.completed
        return None

    def conflict(self, request: BatchRequest) -> str | None:
        """Why this request cannot belong to the batch already drawn for its step, or None."""
        batch = self.find(request.step)
        if batch is None or (batch.world_size, batch.num_groups) == (request.world_size, request.num_groups):
            return None
        return (
            f"step {request.step} was drawn for world_size {batch.world_size} and num_groups {batch.num_groups}, "
            f"not {request.world_size} and {request.num_groups}: every rank must send the same values"
        )

    def add(self, batch: DrawnBatch) -> None:
        if batch.step in self.drawn:
            raise KeyError(f"the batch of step {batch.step} is already drawn")
        self.drawn[batch.step] = batch
        if self.completed is not None and self.completed.step == batch.step:
            self.completed = None

    def delivered(self, step: int, rank: int) -> bool:
        batch = self.find(step)
        return batch is not None and rank in batch.delivered

    def deliver(self, step: int, rank: int) -> None:
        """Rank `rank` got its share of `step`; once every rank has, the batch moves to `completed`."""
        batch = self.drawn[step]
        batch.delivered.add(rank)
        if len(batch.delivered) == batch.world_size:
            self.completed = self.drawn.pop(step)

    def hold(self, reply_to: Any, request: BatchRequest, deadline: float, sender: str = "") -> None:
        self.held[(request.step, request.rank, sender)] = HeldRequest(reply_to, request, deadline, sender)

    def release_all(self) -> list[HeldRequest]:
        """Take every held request out, lowest step first (the caller serves or holds each again)."""
        held = sorted(self.held.values(), key=lambda h: (h.request.step, h.request.rank))
        self.held.clear()
        return held

    def timed_out(self, now: float) -> list[HeldRequest]:
        """Take out the held requests whose deadline has passed."""
        due = [key for key, held in self.held.items() if held.deadline <= now]
        return [self.held.pop(key) for key in due]
