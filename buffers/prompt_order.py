"""The order in which the dispenser hands out fresh prompt instances, after its re-issue queue (`buffers.leases`).

    order = EpochOrder(prompt_ids, seed=0, epochs=0)            # the default: exact epochs
    chosen, cursor = order.draw(count, in_lease, live)          # [(epoch, prompt_id)], changes nothing
    order.advance(cursor, {prompt_id: epoch, ...})               # the grant opened (live, or on journal replay)

`buffers.curriculum.CurriculumOrder` (buffer.curriculum = "pass_rate") is the other order: by pass rate. Both keep
an instance key (epoch or visit, prompt_id) unique for the run, whatever the journal they resume from was written
with: each moves past the other's keys when it meets them (`advance`, `restore`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np


class PromptOrder(Protocol):
    """Which fresh instances a lease gets after the re-issue queue: `EpochOrder`, or `buffers.curriculum`'s
    `CurriculumOrder` (buffer.curriculum = "pass_rate"). `draw` changes nothing; `advance` commits an opened grant
    (live and on replay); a cursor of the other order's form (a journal written before the setting changed) is
    ignored there, so a run resumed with the other setting goes on from where it was."""

    epoch: int

    @property
    def exhausted(self) -> bool: ...

    @property
    def cursor(self) -> list[int]: ...

    def draw(
        self, count: int, in_lease: set[int], live: Mapping[tuple[int, int], Any]
    ) -> tuple[list[tuple[int, int]], list[int]]: ...

    def advance(self, cursor: Sequence[int], prompts: Mapping[int, int]) -> None: ...

    def came_back(self, prompt_id: int) -> None: ...

    def snapshot(self) -> dict[str, Any]: ...

    def restore(self, snapshot: Mapping[str, Any]) -> None: ...


class EpochOrder:
    """The default order: epoch e serves every prompt once, in `permutation(e)`, then e + 1 (module docstring);
    the cursor is [epoch, position]."""

    def __init__(self, prompt_ids: Sequence[int], seed: int, epochs: int) -> None:
        self.prompt_ids, self.seed, self.epochs = list(prompt_ids), seed, epochs
        self.epoch, self.position = 0, 0
        self._permutation: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of epoch `epoch`: positions into the dataset, the same for a given seed."""
        if self._permutation is None or self._permutation[0] != epoch:
            self._permutation = (epoch, np.random.default_rng((self.seed, epoch)).permutation(len(self.prompt_ids)))
        return self._permutation[1]

    @property
    def exhausted(self) -> bool:
        return self.epochs > 0 and self.epoch >= self.epochs

    @property
    def cursor(self) -> list[int]:
        return [self.epoch, self.position]

    def draw(
        self, count: int, in_lease: set[int], live: Mapping[tuple[int, int], Any]
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """The next instances from the cursor, stopping before a prompt id already in the lease (order kept)."""
        chosen: list[tuple[int, int]] = []
        epoch, position = self.epoch, self.position
        while len(chosen) < count and not (self.epochs > 0 and epoch >= self.epochs):
            prompt_id = self.prompt_ids[int(self.permutation(epoch)[position])]
            if prompt_id in in_lease:
                break
            chosen.append((epoch, prompt_id))
            in_lease.add(prompt_id)
            position += 1
            if position == len(self.prompt_ids):
                epoch, position = epoch + 1, 0
        return chosen, [epoch, position]

    def advance(self, cursor: Sequence[int], prompts: Mapping[int, int]) -> None:
        """Move to `cursor`. A curriculum's grant ([draws], a journal written with it on) moves the cursor to the
        start of the epoch after its highest visit, so that no later key meets one of its instance keys."""
        if len(cursor) == 2:
            self.epoch, self.position = int(cursor[0]), int(cursor[1])
        elif max(prompts.values(), default=-1) + 1 > self.epoch:
            self.epoch, self.position = max(prompts.values()) + 1, 0

    def came_back(self, prompt_id: int) -> None:
        """A group for the prompt arrived: nothing changes in an epoch's order."""

    def snapshot(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """A curriculum's snapshot (the run resumed without it) sets epoch to one past its highest visit and
        position 0, so that no new instance key meets one of its own."""
        self.epoch, self.position = snapshot["epoch"], snapshot["position"]
