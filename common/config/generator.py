"""`[generator]`: the vLLM generators' sampling and engine settings."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
)

from common.config.base import MAX_SEED_PART, MAX_TIMEOUT_S, Address, CoreList, _Section


class GeneratorConfig(_Section):
    """One generator process: a vLLM engine that leases prompts and pushes rollout groups."""

    index: int = Field(
        0, description="This generator's index (its identity in leases and logs).", ge=0, le=MAX_SEED_PART
    )
    count: int = Field(1, description="Generators that `tandem run` starts on this machine.", ge=1, le=256)
    buffer_address: Address = Field(
        "127.0.0.1:5555",
        description="host:port of the buffer service. Unset: buffer.host:buffer.port (127.0.0.1 for a wildcard "
        "host); write it when the buffer runs on another machine.",
    )
    weights_address: Address = Field(
        "127.0.0.1:5556",
        description="host:port of the learner's weight publisher. Unset: learner.weights_host:learner.weights_port "
        "(127.0.0.1 for a wildcard host); write it when the learner runs on another machine.",
    )
    temperature: float = Field(1.0, description="Sampling temperature.", gt=0)
    top_p: float = Field(1.0, description="Nucleus sampling.", gt=0, le=1)
    max_tokens: int = Field(128, description="Completion tokens per sample, at most.", ge=1)
    prompts_in_flight: int = Field(
        8,
        description="Prompts the generator holds at once (leased and queued, or generating); it "
        "asks for a new lease as soon as one is built into a group, while the others keep the engine busy.",
        ge=1,
    )
    inflight_weight_update: bool = Field(
        False,
        description="Load new weights between engine steps even with samples in flight (stamped per token); "
        "false = in-flight samples finish under the old version first.",
    )
    kv_cache_gib: float = Field(1.0, description="vLLM CPU KV-cache size (VLLM_CPU_KVCACHE_SPACE).", gt=0)
    enforce_eager: bool | Literal["auto"] = Field(
        "auto",
        description="Run vLLM's model eagerly. `auto`: eagerly on CPU (compiled, SmolLM2 samples ~20% faster on 2 "
        "cores but the engine starts ~100 s slower), with CUDA graphs and torch.compile on GPU (vLLM's default: "
        "eager decode is launch-bound). true / false: so on every platform.",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        description="Fraction of each of its GPUs' memory one generator's vLLM engine takes (weights, activations, "
        "KV cache); vLLM refuses to start when that much is not free. 0.9, below vLLM's own 0.92, leaves room for "
        "what the generator allocates outside vLLM's budget after start (a weight update's staging, an NCCL "
        "communicator). Lower it to share a GPU (`run.share_gpus`). Ignored on CPU (`kv_cache_gib`).",
        gt=0,
        le=1,
    )
    max_unsent_groups: int = Field(256, description="Groups kept while the buffer is unreachable.", ge=1)
    reconnect_max_s: float = Field(
        10.0, description="Longest back-off between reconnect attempts.", gt=0, le=MAX_TIMEOUT_S
    )
    drain_timeout_s: float = Field(
        30.0,
        description="On SIGTERM: longest wait for in-flight samples to finish and be pushed; what is left then "
        "is returned to the buffer (LeaseReturn).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    cpu_cores: CoreList = Field(
        "", description='Cores this generator is pinned to, e.g. `0`, `"0-3,6"` or `[0, 2]` (empty = all).'
    )
    tensor_parallel_size: int = Field(
        1,
        description="GPUs one generator's vLLM engine spans (tensor parallelism; GPU clusters only, the CPU "
        "build runs 1). `tandem ray` reserves this many GPUs per generator when `ray.generator_gpus` > 0.",
        ge=1,
        le=64,
    )
    sim_token_s: float = Field(0.002, description="SIMULATION: seconds per generated token.", ge=0, le=MAX_TIMEOUT_S)
    sim_tokens: int = Field(64, description="SIMULATION: tokens per completion.", ge=1)

    @field_validator("enforce_eager", mode="before")
    @classmethod
    def _eager_as_written(cls, value: Any) -> Any:
        if isinstance(value, bool) or value == "auto":
            return value
        raise ValueError('must be true, false or "auto"')  # not pydantic's lax "yes" or 1
