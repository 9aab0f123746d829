"""Every DeepSpeed call of the learner lives here: process group, engines, backward/step, checkpoints, ZeRO-3 gathers.

    dist = init_distributed()                                    # rank, world_size (gloo on CPU, nccl on GPU)
    policy = TrainEngine(module, EngineSettings(lr=1e-6, zero_stage=1, bf16=True, micro_steps=4, ...))
    for i, micro_batch in enumerate(micro_batches):              # `micro_steps` of them, or any count when
        policy.begin_micro_batch(last=i == len(micro_batches) - 1)  # the caller marks the last one
        loss = ...policy(input_ids=..., attention_mask=...)...
        policy.backward(loss)                                    # accumulates; the loss is NOT rescaled here
        policy.step()                                            # the optimizer steps on the last micro-batch only
    for name, tensor in policy.full_weights():                   # collective under ZeRO-3: every rank iterates
        ...

Gradient convention: `backward(loss)` passes the loss through unscaled (`scale_wrt_gas=False`) and DeepSpeed
averages gradients over the data-parallel ranks. A caller that wants the gradient of one loss over the global
batch therefore passes, per micro-batch, `loss_share * world_size` where the shares sum to that loss over all
ranks and micro-batches (see `learners.trainer`).

ZeRO stages on CPU (DeepSpeed 0.19, gloo): 0, 1, 2 and 3 all train, in float32 and bfloat16
(tests/learners/test_trainer.py: stages 1-3 give stage 0's update, every stage trains in bf16), and ZeRO-1 and
ZeRO-3 with 2 ranks give the update of one rank (tests/learners/test_data_parallel.py). The optimizer is torch's AdamW handed to DeepSpeed as a client optimizer:
DeepSpeed's own FusedAdam/CPUAdam compile a C++ extension on first use (~80 s here), torch's needs nothing. It
runs torch's fused kernel (`fused=True`, one pass over the weights: 0.16 s against 0.87 s for the default
for-each AdamW on SmolLM2's 135M float32 master weights, one CPU core).

Non-finite updates never reach the weights: an optimizer step whose gradients hold a NaN or an infinity on any
rank, or whose micro-batches gave any rank a non-finite loss, is skipped on every rank together. DeepSpeed's ZeRO
(1-3) and bf16 optimizers check the gradients themselves (all-reduced over the ranks) and skip such a step: they
drop the gradients, leave the lr schedule where it is, and count it in `engine.skipped_steps`. With ZeRO off in
float32 the engine steps torch's AdamW directly, so the optimizer handed to it (`_FiniteAdamW`) does the same
check and raises DeepSpeed's `overflow` flag, which makes the engine skip it the same way. A non-finite loss is
all-reduced before the last micro-batch's backward; if any rank saw one, that backward is multiplied by NaN, so
the step takes the same skip whatever the gradients were. `TrainEngine.skipped_steps` counts skipped updates
(restored with a checkpoint), `last_step_skipped` says whether the latest update was one.

Failure modes: every call here is collective under data parallelism (forward/backward/step of ZeRO-3,
`full_weights`, `save`, `load`, `all_reduce`, `barrier`): a rank that skips one hangs the others.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from common.sockets import free_port

GATHER_CHUNK_BYTES = 256 << 20  # ZeRO-3: parameters gathered together at most (bounds the transient memory)


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int


def init_distributed() -> DistInfo:
    """Join (or, alone, create) the process group. Idempotent.

    Without RANK in the environment this process is a single rank: RANK=0, WORLD_SIZE=1 and a free loopback
    MASTER_PORT are set first. The backend is nccl with CUDA, gloo otherwise (the only one that works on CPU).
    """
    import deepspeed

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        bind_local_gpu(local_rank)
    else:
        skip_cpu_shm_op()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    return DistInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), local_rank)


def skip_cpu_shm_op() -> None:
    """Keep DeepSpeed from compiling its shared-memory collective op on the CPU (`deepspeed.comm.torch.build_shm_op`,
    called by every `init_distributed`). That op serves only `inference_all_reduce` (DeepSpeed's tensor-parallel
    inference); training's all-reduce is torch.distributed's over gloo either way. The compile took 37-46 s of both
    cores of a 2-core EPYC at each new venv path (a fresh clone, the demo's first run), every learner started meanwhile
    waited on its lock, and one interrupted mid-build left a lock in ~/.cache/torch_extensions that stalled every later
    learner for good. `build_shm_op` builds only what `deepspeed.ops.__compatible_ops__` marks compatible; that dict
    is made once per process and edits to it persist (deepspeed/ops/__init__.py)."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def bind_local_gpu(local_rank: int) -> None:
    """Make cuda:`local_rank` this thread's current device, before anything reads `device()`: torch's
    `init_process_group` does not, and DeepSpeed does only inside `deepspeed.initialize`, after `Trainer` placed
    its inputs and reference model (ranks >= 1 on one node would put them on cuda:0). Raises ValueError when this
    rank's GPU is not visible (fewer GPUs than ranks on the node)."""
    visible = torch.cuda.device_count()
    if local_rank >= visible:
        raise ValueError(
            f"learner rank with LOCAL_RANK {local_rank} needs GPU {local_rank}, and this process sees {visible} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): give the learner "
            "learner.world_size GPUs per node, or fewer ranks"
        )
    torch.cuda.set_device(local_rank)


def world_size() -> int:
    import deepspeed.comm as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (op="sum") or maximum (op="max") of `tensor` over all ranks, in place; returns it. No-op alone.

    `tensor` may live anywhere: the collective runs on this rank's `device()` (NCCL has no CPU backend, and the
    callers' statistics are host tensors), through a copy when it lives elsewhere, copied back after."""
    import deepspeed.comm as dist

    if world_size() > 1:
        target = device()
        staged = tensor if tensor.device == target else tensor.to(target)
        dist.all_reduce(staged, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        if staged is not tensor:
            tensor.copy_(staged)
    return tensor


def barrier() -> None:
    """Wait until every rank gets here (no-op alone)."""
    import deepspeed.comm as dist

    if world_size() > 1:
        dist.barrier()


def device() -> torch.device:
    """The device this rank's engines run on (the accelerator DeepSpeed picked)."""
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    return torch.device(name if name == "cpu" else f"{name}:{get_accelerator().current_device()}")


@dataclass(frozen=True)
class EngineSettings:
    """What one engine needs: optimizer, precision, ZeRO stage and the micro-steps of one update."""

    lr: float
    zero_stage: int
    bf16: bool
    micro_batch_size: int
    micro_steps: int  # gradient-accumulation steps: micro-batches per optimizer step on this rank
    weight_decay: float = 0.0
    grad_clip: float = 0.0  # 0 = no clipping
    warmup_steps: int = 0  # linear warm-up from lr / warmup_steps to lr
    lr_schedule: str = "constant"  # after warm-up: "constant", or "cosine" down to min_lr_ratio * lr at decay_steps
    min_lr_ratio: float = 0.1
    decay_steps: int = 0  # optimizer steps of the whole run (cosine only; TrainEngine.decay_over sets it late)

    def deepspeed_config(self, world_size: int) -> dict[str, Any]:
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.micro_steps,
            "train_batch_size": self.micro_batch_size * self.micro_steps * world_size,
            "zero_optimization": {"stage": self.zero_stage},
            "bf16": {"enabled": self.bf16, "check_grad_overflow": True},  # skip non-finite steps (module docstring)
            "gradient_clipping": self.grad_clip,
            "zero_allow_untested_optimizer": True,  # torch AdamW (see the module docstring)
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }


def lr_factor(step: int, settings: EngineSettings) -> float:
    """The learning rate at optimizer step `step` (0-based) over settings.lr: a linear warm-up to 1 over
    warmup_steps, then 1 ("constant"), or a half cosine from 1 at the end of the warm-up down to min_lr_ratio at
    decay_steps, flat after it ("cosine", OpenRLHF's cosine_with_min_lr). A run that ends on a small step
    finishes near a minimum instead of wherever its last full-size step left it."""
    warmup = max(1, settings.warmup_steps)
    if step + 1 < warmup:
        return (step + 1) / warmup
    if settings.lr_schedule == "constant" or settings.decay_steps <= warmup:
        return 1.0
    progress = min(1.0, (step + 1 - warmup) / (settings.decay_steps - warmup))
    low = settings.min_lr_ratio
    return low + (1.0 - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


class TrainEngine:
    """A module trained by one DeepSpeed engine (policy or critic). Calls are collective across ranks."""

    def __init__(self, module: torch.nn.Module, settings: EngineSettings) -> None:
        import deepspeed

        self.settings = settings
        trainable = [p for p in module.parameters() if p.requires_grad]

        def make_optimizer(params: Any) -> torch.optim.Optimizer:
            # ZeRO-0 checks on all ranks (its gradients are whole); ZeRO's optimizers checked before calling it
            return _FiniteAdamW(
                params, settings.zero_stage == 0, lr=settings.lr, weight_decay=settings.weight_decay, fused=True
            )

        def make_scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
            return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, self.settings))

        self._nonfinite_loss = False  # a micro-batch of the current update had a non-finite loss on this rank
        self.last_step_skipped = False  # the latest optimizer step was skipped (non-finite loss or gradient)
        self.engine, *_ = deepspeed.initialize(
            model=module,
            model_parameters=trainable,
            optimizer=make_optimizer,
            lr_scheduler=make_scheduler,
            config=settings.deepspeed_config(world_size()),
        )

    def decay_over(self, steps: int) -> None:
        """Set the cosine schedule's horizon (settings.decay_steps) to `steps` optimizer steps, for a caller that
        knows the run's length only after the engine exists (the offline stages count their rows first). Call it
        before the first step (whose lr does not depend on the horizon); the lr schedule reads the settings at
        every step."""
        self.settings = replace(self.settings, decay_steps=steps)

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped module (its parameters are partitioned, i.e. empty, under ZeRO-3 outside a gather)."""
        return self.engine.module

    @property
    def zero3(self) -> bool:
        return self.settings.zero_stage == 3

    def __call__(self, **inputs: Any) -> Any:
        return self.engine(**inputs)

    def train(self, mode: bool = True) -> None:
        self.engine.train(mode)

    def begin_micro_batch(self, last: bool) -> None:
        """Say, before a micro-batch's forward, whether it is the last of its optimizer step (DeepSpeed's public
        `set_gradient_accumulation_boundary`, which `is_gradient_accumulation_boundary` then returns for ZeRO 0-3:
        gradients are reduced and the optimizer steps at the `step()` after that micro-batch's backward). A
        caller that says so before every micro-batch may vary the micro-batches per step; `micro_steps` in the
        settings is then only DeepSpeed's nominal gradient_accumulation_steps. Every rank must give the same
        sequence (the reduction at the boundary is collective)."""
        self.engine.set_gradient_accumulation_boundary(last)

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate d loss; the loss is not divided by the micro-steps (see the module docstring). On the last
        micro-step, a non-finite loss seen by any rank in this update makes every rank skip the step."""
        self._nonfinite_loss |= not bool(torch.isfinite(loss.detach()).all())
        if self.engine.is_gradient_accumulation_boundary():
            flag = torch.tensor([float(self._nonfinite_loss)], device=loss.device)
            if all_reduce(flag, "max").item() > 0:
                loss = loss * float("nan")  # every gradient NaN: DeepSpeed's overflow check skips the step
            self._nonfinite_loss = False
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> None:
        """Call after every backward; the optimizer (and lr scheduler) steps on the last micro-step only, unless
        the update is not finite (see the module docstring: then `last_step_skipped` is True)."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        self.engine.step()
        if boundary:
            self.last_step_skipped = not self.engine.was_step_applied()

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped as not finite since training began (DeepSpeed's count, kept in checkpoints)."""
        return int(self.engine.skipped_steps)

    @property
    def optimizer_steps(self) -> int:
        return int(self.engine.global_steps)

    def learning_rate(self) -> float:
        return float(self.engine.get_lr()[0])

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every parameter in `named_parameters` order (tied weights once).

        Collective under ZeRO-3: every rank must exhaust the iterator. A yielded tensor is valid only until the
        next one is requested (its gather is released): copy it, do not keep it.
        """
        import deepspeed

        named = list(self.module.named_parameters())
        if not self.zero3:
            yield from ((name, param.detach()) for name, param in named)
            return
        for chunk in _chunks_by_bytes(named, GATHER_CHUNK_BYTES):
            with deepspeed.zero.GatheredParameters([param for _, param in chunk], modifier_rank=None):
                yield from ((name, param.detach()) for name, param in chunk)

    @property
    def has_frozen_parameters(self) -> bool:
        """Whether some parameters never train (a LoRA model's base weights): checkpoints leave them out."""
        return any(not p.requires_grad for p in self.module.parameters())

    def save(self, directory: Path, tag: str) -> None:
        """DeepSpeed checkpoint (module, optimizer, scheduler; each rank its shard). Collective. Frozen parameters
        are left out (they are the model directory's, unchanged): a LoRA checkpoint holds the adapters, and a tied
        output layer (DeepSpeed drops frozen parameters by their `named_parameters` names, which name a tied
        weight once, as the embedding, while the state dict holds it under both names)."""
        frozen = self.has_frozen_parameters
        self.engine.save_checkpoint(str(directory), tag=tag, save_latest=False, exclude_frozen_parameters=frozen)

    def load(self, directory: Path, tag: str) -> None:
        """Restore what `save` wrote; raises FileNotFoundError when `directory/tag` is missing. Collective."""
        if not (directory / tag).is_dir():
            raise FileNotFoundError(f"{directory / tag}: no DeepSpeed checkpoint (was it saved with tag '{tag}'?)")
        # a checkpoint without the frozen parameters (see `save`) leaves them as the module loaded them
        path, _ = self.engine.load_checkpoint(
            str(directory), tag=tag, load_module_strict=not self.has_frozen_parameters
        )
        if path is None:
            raise RuntimeError(f"{directory / tag}: DeepSpeed could not load this checkpoint (see its log above)")


class _FiniteAdamW(torch.optim.AdamW):
    """torch's AdamW that refuses a step whose gradients are not all finite, and says so in `overflow` (the flag
    DeepSpeed's engine reads after stepping an optimizer: it then counts the step as skipped, zeroes the
    gradients and does not advance the lr schedule). `all_ranks`: agree over the data-parallel ranks (a
    collective; only where every rank steps this optimizer at the same point, as ZeRO-0 does)."""

    def __init__(self, params: Any, all_ranks: bool, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.all_ranks = all_ranks
        self.overflow = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        # max and min carry any NaN and any infinity: two reductions, no [numel] boolean temporaries
        finite = torch.tensor(True)
        if grads:
            finite = torch.stack([torch.isfinite(g.amax()) & torch.isfinite(g.amin()) for g in grads]).all()
        flag = (~finite).float().reshape(1)
        self.overflow = bool((all_reduce(flag, "max") if self.all_ranks else flag).item() > 0)
        if self.overflow:
            return None
        return super().step(closure)


def _chunks_by_bytes(named: list[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, param in named:
        numel = getattr(param, "ds_numel", param.numel())
        chunk.append((name, param))
        size += numel * param.element_size()
        if size >= limit:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk
