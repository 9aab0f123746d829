"""Placement groups for a fleet whose size changes: learner ranks packed together, generators spread out.

    learners = BundlePool("my-run", "learner", {"CPU": 1, "GPU": 1}, "PACK", timeout_s=120)
    slots = learners.acquire(4)               # one placement group of 4 bundles, packed on as few nodes as fit
    generators = BundlePool("my-run", "generator", {"CPU": 1}, "SPREAD", timeout_s=120)
    generators.room_problem(2)                # None, or at once: what is free and what 2 more would reserve
    more = generators.acquire(2)              # reuses freed bundles first, else a new group of the rest, spread
    generators.release(more[0])               # a group none of whose bundles is used any more is removed
    actor_cls.options(scheduling_strategy=slot.strategy(), ...)

Ray reserves a placement group all at once (gang scheduling) and never resizes it, so growing a fleet adds a
group for the new members, and shrinking frees bundles; a replacement for a member that died takes the
freed bundle of the same group, hence the same node. Failure mode: a group that cannot be placed within
`timeout_s` (not enough free CPUs/GPUs) is removed and PlacementError says what it asked for and what is free
(CPUs and GPUs: never Ray's internal per-group resource names).
Not thread-safe: the fleet controller calls it under its lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class PlacementError(RuntimeError):
    """The cluster could not place a placement group in time; the message names the request."""


@dataclass(frozen=True)
class Slot:
    """One bundle of one placement group: where one fleet member runs."""

    group: Any  # ray.util.placement_group.PlacementGroup
    index: int

    def strategy(self) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.group,
            placement_group_bundle_index=self.index,
            placement_group_capture_child_tasks=False,
        )


class BundlePool:
    """Bundles of identical size for one role, in as many placement groups as growth required."""

    def __init__(self, run_name: str, label: str, bundle: dict[str, float], strategy: str, timeout_s: float) -> None:
        self.run_name = run_name
        self.label = label
        self.bundle = {key: value for key, value in bundle.items() if value > 0} or {"CPU": 0.001}
        self.strategy = strategy
        self.timeout_s = timeout_s
        self.free: list[Slot] = []
        self.used: set[Slot] = set()
        self.groups = 0  # placement groups held now
        self.serial = 0  # placement groups made so far (their names: tandem:<run>:<label>s-<serial>)

    def acquire(self, count: int) -> list[Slot]:
        """`count` slots: freed ones first, then a new placement group for the rest (waits until placed)."""
        taken = [self.free.pop() for _ in range(min(count, len(self.free)))]
        if len(taken) < count:
            taken += self._new_group(count - len(taken))
        self.used.update(taken)
        return taken

    def room_problem(self, count: int) -> str | None:
        """None when `count` more slots look placeable now: this pool's free slots first, then new bundles out of
        the cluster's free CPUs/GPUs in all; else what is free and what was asked, in one line. (A bundle must
        also fit on one node, and other work may take resources meanwhile: acquire() finds that out, later.)"""
        import ray

        new = count - len(self.free)
        if new <= 0:
            return None
        free, total = ray.available_resources(), ray.cluster_resources()
        for resource, each in self.bundle.items():
            have = float(free.get(resource, 0.0))
            if new * each > have + 1e-9:  # 1e-9: Ray counts resources in units of 1e-4, so sums of them are exact
                return (
                    f"{new} more {self.label}(s) reserve {new * each:g} {resource} ({each:g} each); the cluster has "
                    f"{have:g} {resource} free of {float(total.get(resource, 0.0)):g}: lower "
                    f"ray.{self.label}_{resource.lower()}s, ask for fewer, or add nodes"
                )
        return None

    def release(self, slot: Slot) -> None:
        """The member of `slot` is gone; the slot is reusable, and its group is removed once all of it is free."""
        import ray

        self.used.discard(slot)
        self.free.append(slot)
        if not any(used.group == slot.group for used in self.used):
            self.free = [free for free in self.free if free.group != slot.group]
            ray.util.remove_placement_group(slot.group)
            self.groups -= 1

    def close(self) -> None:
        """Remove every placement group (their actors must be gone or are killed by Ray)."""
        import ray

        for group in {slot.group for slot in (*self.used, *self.free)}:
            ray.util.remove_placement_group(group)
        self.free, self.used, self.groups = [], set(), 0

    def _new_group(self, count: int) -> list[Slot]:
        import ray
        from ray.exceptions import GetTimeoutError

        group = ray.util.placement_group(
            [dict(self.bundle) for _ in range(count)],
            strategy=self.strategy,
            name=f"tandem:{self.run_name}:{self.label}s-{self.serial}",
        )
        self.serial += 1
        try:
            ray.get(group.ready(), timeout=self.timeout_s)
        except GetTimeoutError:
            ray.util.remove_placement_group(group)
            raise PlacementError(
                f"could not place {count} x {self.bundle} ({self.label}, {self.strategy}) within "
                f"{self.timeout_s:.0f}s; free now: {describe(ray.available_resources())}. Lower the "
                f"ray.{self.label}_* reservations, add nodes, or raise ray.placement_timeout_s"
            ) from None
        self.groups += 1
        return [Slot(group, index) for index in range(count)]


def describe(resources: dict[str, Any]) -> str:
    """ "2.5 CPU, 0 GPU": the CPUs and GPUs of `ray.available_resources()`, without Ray's per-placement-group
    entries (`CPU_group_<id>`, `bundle_group_<id>`), memory and node labels."""
    return ", ".join(f"{float(resources.get(key, 0.0)):g} {key}" for key in ("CPU", "GPU"))
