"""Which GPUs each role of `tandem run` sees (CUDA_VISIBLE_DEVICES). Pure functions of the config and of the GPUs
this machine shows, so they are tested without a GPU:

    gpus = visible_gpus()                  # ["0", "1", "2", "3"]: CUDA_VISIBLE_DEVICES's list, else torch's count
    problem = gpu_problem(config, gpus)    # None, or one line: what is missing and what to change
    plan = plan_gpus(config, gpus)         # None without GPUs: the CPU path, no role's environment changes
    plan.env("generator-1")                # {"CUDA_VISIBLE_DEVICES": "2"}

The order is what `tandem ray` reserves (launch/ray/plan.py, resource_demand): `learner.world_size` GPUs to the
learner (torchrun's ranks take cuda:LOCAL_RANK among them), `generator.tensor_parallel_size` to each generator in
index order, one to the reward service when the run has one (`config.reward_service`). The buffer, and any role
not named in the plan, sees none (CUDA_VISIBLE_DEVICES=""). Without a plan every role would see every GPU: each
vLLM, learner rank 0 and the reward model would all start on cuda:0.

Fewer GPUs than that: refused, unless `run.share_gpus`; then the same order starts again from the first GPU (one
GPU: every role on it). Even then two learner ranks, or the GPUs of one tensor-parallel engine, never share one
(NCCL refuses a communicator with one device twice), and the vLLM engines on a GPU that also holds another role take
at most SHARED_GPU_ENGINE_SHARE of it together: vLLM checks at start that its fraction
(`generator.gpu_memory_utilization`) of the whole GPU is free, and the learner, started first, holds its share.
In SIMULATION mode no role uses a GPU: no plan, no check.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from common.config import TandemConfig
from common.devices import listed_gpus

SHARED_GPU_ENGINE_SHARE = 0.5  # of a shared GPU, for its vLLM engines together; the learner and reward model: the rest


def visible_gpus(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The GPUs this launcher may hand out, as a child's CUDA_VISIBLE_DEVICES names them: the launcher's own
    CUDA_VISIBLE_DEVICES list when it is set (up to its first negative entry, as CUDA reads it; empty: none), else
    0..N-1 for torch.cuda.device_count() (NVML or the driver's count: no CUDA context is created). A CPU build of
    torch, or a driver torch cannot use, shows none."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return listed_gpus(listed)
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


def gpu_demand(config: TandemConfig) -> list[tuple[str, int]]:
    """(role name, GPUs) in the order they are handed out (the module docstring)."""
    generator = config.generator
    demand = [("learner-0", config.learner.world_size)]
    demand += [(f"generator-{index}", generator.tensor_parallel_size) for index in range(generator.count)]
    if config.reward_service:
        demand.append(("reward-0", 1))
    return demand


@dataclass(frozen=True)
class GpuPlan:
    """Each role's GPUs (role name -> device names, in order); `shared`: fewer GPUs than roles need, on purpose."""

    devices: dict[str, tuple[str, ...]]
    shared: bool

    def env(self, role: str) -> dict[str, str]:
        """The role's CUDA_VISIBLE_DEVICES: its GPUs, or "" (none) for a role the plan does not name."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.devices.get(role, ()))}

    def describe(self) -> str:
        """`learner-0 0,1; generator-0 2; reward-0 3` for the launcher's log."""
        return "; ".join(f"{role} {','.join(devices)}" for role, devices in self.devices.items())


def plan_gpus(config: TandemConfig, gpus: Sequence[str]) -> GpuPlan | None:
    """Hand `gpus` out in gpu_demand's order, from the first again when they run out (`run.share_gpus`: check
    gpu_problem first). None in SIMULATION mode or without GPUs: every role keeps the launcher's environment."""
    if config.run.simulate or not gpus:
        return None
    devices, position = {}, 0
    for role, count in gpu_demand(config):
        devices[role] = tuple(gpus[(position + offset) % len(gpus)] for offset in range(count))
        position += count
    return GpuPlan(devices, shared=position > len(gpus))


def gpu_problem(config: TandemConfig, gpus: Sequence[str]) -> str | None:
    """None when the roles can have `gpus` as plan_gpus hands them out; else one line saying what is missing and
    what to change (the module docstring has the rules)."""
    plan = plan_gpus(config, gpus)
    if plan is None or not plan.shared:
        return None
    generator, ranks, have = config.generator, config.learner.world_size, len(gpus)
    if not config.run.share_gpus:
        need = sum(count for _, count in gpu_demand(config))
        parts = [f"learner {ranks}", f"{generator.count} generators x TP {generator.tensor_parallel_size}"]
        parts += ["reward 1"] if config.reward_service else []
        return (
            f"needs {need} GPUs ({', '.join(parts)}), this machine has {have}: lower generator.count, "
            "generator.tensor_parallel_size or learner.world_size, or set run.share_gpus = true to share them"
        )
    for key, wanted in (
        ("learner.world_size", ranks),
        ("generator.tensor_parallel_size", generator.tensor_parallel_size),
    ):
        if wanted > have:
            return (
                f"{key} = {wanted} needs {wanted} distinct GPUs even with run.share_gpus (NCCL cannot use one GPU "
                f"twice in a group), this machine has {have}: lower {key}"
            )
    holders = Counter(gpu for devices in plan.devices.values() for gpu in set(devices))
    engines = Counter(gpu for role, devices in plan.devices.items() if role.startswith("generator") for gpu in devices)
    crowded = max((engines[gpu] for gpu in engines if holders[gpu] > 1), default=0)
    taken = crowded * generator.gpu_memory_utilization
    if taken > SHARED_GPU_ENGINE_SHARE + 1e-9:
        most = math.floor(SHARED_GPU_ENGINE_SHARE / crowded * 100) / 100
        return (
            f"run.share_gpus: {crowded} vLLM engine(s) on a shared GPU take generator.gpu_memory_utilization = "
            f"{generator.gpu_memory_utilization:g} of it each ({taken:g} in all), more than the "
            f"{SHARED_GPU_ENGINE_SHARE:g} left beside the learner and the reward model: set "
            f"generator.gpu_memory_utilization = {most:g} or lower"
        )
    return None
