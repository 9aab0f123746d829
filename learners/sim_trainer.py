"""SIMULATION stand-in for the DeepSpeed trainer (`run.simulate = true`): same interface, no model.

    trainer = SimulatedTrainer(config.learner, config.algo)
    stats = trainer.train_step(groups, staleness)      # sleeps sim_sample_s x samples / learner.world_size
    publisher.publish(version, trainer.weight_layout(), trainer.full_weights())   # sim_weights_mb real bytes

What is simulated: the compute of an update (wall time only) and the weights' content (float32 buffers of
`sim_weights_mb` MiB whose first element is the step, so each version differs; with learner.lora.sync = "adapter",
LoRA A/B matrices of the first target module, named as the contract names them, as the generators' adapter checks
want). What stays real: the batch it
is given, the reward/staleness/token statistics it reports (the same `rollout_summary` as the real trainer),
the bytes the publisher copies and serves, checkpoints of its state, and everything around it in the loop.
It reports no `loss/*` or `policy/*` keys: there is no policy.

Ranks: the simulation is ONE process that takes the whole global batch and divides the cost by
`learner.world_size`, as that many data-parallel ranks would (no process group, no torchrun).

Why sleep and not busy compute: the simulation stands for a learner on its own accelerator, which does not
compete with the generators for CPU time. Sleeping keeps the learner's cost out of the generators' cores, so
the simulated overlap between acting and learning is what separate hardware would give; a busy loop on a
shared 2-core machine would measure CPU contention instead.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from common.config import AlgoConfig, LearnerConfig
from common.types import RolloutGroup
from learners.rollout_stats import rollout_summary

SIM_TENSORS = 4  # the simulated weights are split into this many tensors (several buckets, like a real model)
STATE_FILE = "sim_trainer.json"


class SimulatedTrainer:
    """SIMULATION: a trainer that costs `sim_sample_s` seconds per sample and publishes `sim_weights_mb` MiB.

    One process stands for `learner.world_size` ranks (see the module docstring).
    """

    def __init__(self, learner: LearnerConfig, algo: AlgoConfig) -> None:
        self.sample_seconds = learner.sim_sample_s / learner.world_size
        self.max_staleness = algo.max_staleness
        self.steps = 0
        total = int(learner.sim_weights_mb * (1 << 20)) // 4  # float32 elements
        lora = learner.lora
        if lora.rank > 0 and lora.sync == "adapter":  # SIM_TENSORS matrices: A [rank, n] and B [n, rank] pairs
            n = max(1, total // (SIM_TENSORS * lora.rank))
            stems = [f"sim.layers.{i}.{lora.target_modules[0]}" for i in range(SIM_TENSORS // 2)]
            self.weights = {
                f"{stem}.lora_{half}.weight": np.zeros(shape, dtype=np.float32)
                for stem in stems
                for half, shape in (("A", (lora.rank, n)), ("B", (n, lora.rank)))
            }
            return
        sizes = [total // SIM_TENSORS + (1 if i < total % SIM_TENSORS else 0) for i in range(SIM_TENSORS)]
        self.weights = {
            f"sim.layers.{i}.weight": np.zeros(size, dtype=np.float32) for i, size in enumerate(sizes) if size > 0
        }

    def train_step(self, groups: Sequence[RolloutGroup], staleness: Sequence[np.ndarray]) -> dict[str, float]:
        """Wait sim_sample_s x samples / world_size, mark the weights with the new step; return the statistics."""
        summary = rollout_summary(groups, staleness, self.max_staleness)
        start = time.perf_counter()
        time.sleep(self.sample_seconds * sum(g.size for g in groups))
        self.steps += 1
        for array in self.weights.values():
            array.flat[0] = self.steps
        elapsed = time.perf_counter() - start
        return {**summary, "perf/forward_s": elapsed / 3, "perf/backward_s": 2 * elapsed / 3, "sim/steps": self.steps}

    def weight_layout(self) -> list[tuple[str, str, list[int]]]:
        return [(name, "float32", list(array.shape)) for name, array in self.weights.items()]

    def full_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        return iter(self.weights.items())

    def save_state(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / STATE_FILE).write_text(json.dumps({"steps": self.steps}))

    def load_state(self, directory: Path) -> None:
        self.steps = int(json.loads((directory / STATE_FILE).read_text())["steps"])
        for array in self.weights.values():
            array.flat[0] = self.steps
