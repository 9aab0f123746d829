"""`[learner]` and `[learner.lora]`: DeepSpeed ranks, batches, optimizer, checkpoints."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
)

from common.config.base import MAX_MESSAGE_MB, MAX_TIMEOUT_S, Address, CoreList, Host, _Section

# Llama's (and SmolLM2's) linear projections: every attention and MLP matrix, the usual LoRA targets.
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_LORA_RANK = 4096  # as common.weight_messages.WeightsHeader.lora_rank (vLLM serves adapters up to rank 512)


def _check_module_names(names: list[str]) -> list[str]:
    if len(set(names)) != len(names):
        raise ValueError("a module name is repeated")
    for name in names:
        if not (name.isidentifier() and name.isascii() and len(name) <= 100):
            raise ValueError(
                f"{name[:40]!r} is not a module name (the last part of a linear layer's name, e.g. 'q_proj')"
            )
    return names


class LoraConfig(_Section):
    """LoRA adapters on the learner's policy, and on the critic's backbone when there is one (peft, the `lora`
    extra): only the adapters train (the critic's value head too), the base weights stay frozen. rank 0 = off."""

    rank: int = Field(
        0, description="Adapter rank r (0 = no adapters: full fine-tuning). 8-64 is usual.", ge=0, le=MAX_LORA_RANK
    )
    alpha: float = Field(
        16.0, description="Adapter scale numerator: the update is W + (alpha / rank) B A.", gt=0, le=1e6
    )
    dropout: float = Field(0.0, description="Dropout on the adapters' input while training.", ge=0, lt=1)
    target_modules: Annotated[list[str], AfterValidator(_check_module_names)] = Field(
        default_factory=lambda: list(LLAMA_PROJECTIONS),
        description="Last parts of the names of the linear layers that get adapters; a name that matches no "
        "linear layer of the model is refused when it loads (the error lists the model's linear layers).",
        min_length=1,
        max_length=64,
    )
    sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="What a weight update carries. merged: the full weights, each adapted one merged as "
        "W + (alpha / rank) B A (every engine takes it, as without LoRA); adapter: only the A and B matrices (a "
        "few % of the bytes), for generators whose vLLM runs with LoRA enabled (a LoRARequest per version).",
    )


class LearnerConfig(_Section):
    """The learner: DeepSpeed rank(s) that train on batches and publish weights."""

    world_size: int = Field(
        1, description="Data-parallel ranks in all (learner.nnodes hosts x the ranks on each).", ge=1, le=1024
    )
    nnodes: int = Field(
        1,
        description="Hosts the ranks span when started by hand (`tandem learner` on each, as with torchrun): "
        "world_size / nnodes ranks on each. Each host is given its learner.node_rank; all reach "
        "learner.master_addr:learner.master_port, and the buffer. The run directory must be one shared path "
        "(checkpoints are written by every host). `tandem ray` places multi-node ranks itself (docs/clusters.md).",
        ge=1,
        le=1024,
    )
    node_rank: int = Field(
        0, description="This host's place among learner.nnodes (0: the one whose rank 0 publishes weights).", ge=0
    )
    master_addr: Host = Field(
        "127.0.0.1",
        description="With learner.nnodes > 1: the address of the host with node_rank 0, where the ranks meet "
        "(torch.distributed's rendezvous); every host must reach it. Gloo picks the interface that routes to "
        "it; set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on GPUs) when a host has several.",
    )
    master_port: int | None = Field(
        None,
        description="The rendezvous port on learner.master_addr, the same on every host. Unset: 29500 (torchrun's "
        "default) with learner.nnodes > 1, a free port on one host.",
        ge=1,
        le=65535,
    )
    buffer_address: Address = Field(
        "127.0.0.1:5555",
        description="host:port of the buffer service. Unset: buffer.host:buffer.port (127.0.0.1 for a wildcard "
        "host); write it when the buffer runs on another machine.",
    )
    weights_host: Host = Field(
        "127.0.0.1",
        description="Address the weight publisher binds (loopback by default; any other needs run.curve_keys_dir "
        "or run.insecure).",
    )
    weights_port: int = Field(
        5556, description="Port of the weight publisher (unset: run.port_base + 1, else 5556).", ge=1, le=65535
    )
    groups_per_step: int = Field(4, description="Groups (prompts) in one global batch.", ge=1)
    micro_batch_size: int = Field(
        8, description="Sequences per forward/backward on one rank (when max_tokens_per_micro_batch = 0).", ge=1
    )
    mini_batches: int = Field(
        1,
        description="Optimizer steps per pass over a batch: a rank's share is split into this many mini-batches "
        "(whole groups when the groups divide evenly), each split into micro-batches (DeepSpeed's gradient "
        "accumulation). With algo.ppo_epochs, ppo_epochs x mini_batches steps per batch; warmup_steps and the "
        "lr schedule count these optimizer steps, total_steps counts batches. Must divide a rank's share "
        "(groups_per_step / world_size x algo.group_size samples).",
        ge=1,
    )
    max_tokens_per_micro_batch: int = Field(
        0,
        description="0 = micro-batches of micro_batch_size sequences; > 0 = micro-batches of at most this many "
        "prompt + completion tokens (padding not counted; a longer sample gets a micro-batch of its own, with a "
        "warning). All ranks take the same number of micro-steps.",
        ge=0,
    )
    packing: bool = Field(
        False,
        description="Pack several samples into one row (position_ids restart per sample, no attention across "
        "samples) instead of padding each to the longest; needs max_tokens_per_micro_batch > 0. Same update.",
    )
    total_steps: int = Field(
        100, description="Steps (batches) to train; each is algo.ppo_epochs x mini_batches optimizer steps.", ge=1
    )
    lr: float = Field(1e-6, description="Learning rate.", gt=0)
    weight_decay: float = Field(0.0, description="AdamW weight decay.", ge=0)
    grad_clip: float = Field(1.0, description="Gradient norm clip (0 = none).", ge=0)
    warmup_steps: int = Field(0, description="Linear learning-rate warm-up steps.", ge=0)
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="After the warm-up: `constant`, or `cosine`: a half cosine down to min_lr_ratio x lr at the "
        "run's last optimizer step (OpenRLHF's cosine_with_min_lr), so a short run ends on small steps.",
    )
    min_lr_ratio: float = Field(0.1, description="lr_schedule = cosine: the last step's lr over lr.", ge=0, le=1)
    zero_stage: Literal[0, 1, 2, 3] = Field(1, description="DeepSpeed ZeRO stage.")
    sync_every: int = Field(1, description="Publish weights every this many steps.", ge=1)
    save_every: int = Field(
        0, description="Checkpoint every this many steps (0 = only at the end, and on an interrupt).", ge=0
    )
    resume: bool = Field(
        False,
        description="Continue from the latest complete checkpoint in the run dir (records of later steps in "
        "metrics.jsonl are dropped: they are trained again). Without it a run dir that holds a run is refused.",
    )
    save_on_interrupt: bool = Field(
        True,
        description="On SIGINT or SIGTERM: finish the step in flight, save a checkpoint, then exit (130 or 143). "
        "false = exit after the step without one (a resume continues from the last save_every checkpoint).",
    )
    stop_timeout_s: float = Field(
        120.0,
        description="How long `tandem run` and `tandem ray` wait for a stopping learner (its step in flight, then "
        "the checkpoint of save_on_interrupt) before they kill it.",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    wait_report_s: float = Field(
        120.0,
        description="A wait for a batch longer than this (and than 3x the median step time) is explained in one "
        "line: the generation rate, what one batch needs, groups refused, leases expired, and what to change; "
        "logged, in waiting.jsonl and printed by `tandem run`, then every few minutes while it lasts.",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    gradient_checkpointing: bool = Field(False, description="Trade compute for activation memory.")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = Field(
        "sdpa",
        description="The policy's, reference's and critic's attention kernels (transformers' attn_implementation). "
        "flash_attention_2 needs the flash-attn package on a GPU (pip install flash-attn --no-build-isolation, "
        "after torch); with learner.packing it puts each micro-batch's samples in one row (the varlen kernel, no "
        "mask), where sdpa packs rows with a dense block-diagonal mask.",
    )
    critic_lr: float = Field(5e-6, description="Critic learning rate (estimator = gae).", gt=0)
    critic_path: str = Field(
        "",
        description="Where the critic (estimator = gae) starts: a model.path value. A reward model (e.g. the "
        "<run_dir>/model that tandem rm exports) gives its backbone and its scalar head, so the first values are "
        "its scores; empty = the policy's backbone with a zero head (V = 0 at first).",
    )
    cpu_cores: CoreList = Field(
        "", description="Cores the learner ranks are pinned to, written as generator.cpu_cores (empty = all)."
    )
    sim_sample_s: float = Field(0.05, description="SIMULATION: seconds of training per sample.", ge=0, le=MAX_TIMEOUT_S)
    sim_weights_mb: float = Field(
        256.0, description="SIMULATION: size of the published weights in MiB.", ge=0, le=MAX_MESSAGE_MB
    )
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="[learner.lora]: LoRA adapters instead of full fine-tuning (see the section below).",
    )
