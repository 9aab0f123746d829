"""`[ray]`: placement of the roles on a Ray cluster (`tandem ray`)."""

from __future__ import annotations

from pydantic import (
    Field,
)

from common.config.base import MAX_TIMEOUT_S, _Section


class RayConfig(_Section):
    """`tandem ray`: where the fleets run on a Ray cluster and what each role instance reserves there."""

    address: str = Field(
        "",
        description="Ray cluster to join (`auto`, `ray://host:10001`, `host:6379`); empty = `RAY_ADDRESS`, else "
        "start a local Ray on this machine (its roles then bind loopback; on a joined cluster they bind their "
        "node's IP, which needs run.curve_keys_dir or run.insecure).",
    )
    buffer_cpus: float = Field(1.0, description="CPUs reserved for the buffer.", ge=0)
    generator_cpus: float = Field(1.0, description="CPUs reserved per generator (fractions allowed).", ge=0)
    generator_gpus: float = Field(
        0.0, description="GPUs reserved per generator: 0 on CPU clusters, else generator.tensor_parallel_size.", ge=0
    )
    learner_cpus: float = Field(1.0, description="CPUs reserved per learner rank.", ge=0)
    learner_gpus: float = Field(0.0, description="GPUs reserved per learner rank (0 or 1 on GPU clusters).", ge=0)
    reward_cpus: float = Field(1.0, description="CPUs reserved for the reward service (env.reward_model).", ge=0)
    reward_gpus: float = Field(0.0, description="GPUs reserved for the reward service (0 on CPU clusters).", ge=0)
    max_generator_restarts: int = Field(
        16,
        description="Generators that died (process or actor) and were replaced, at most, over the run; one more "
        "death fails the run.",
        ge=0,
    )
    max_reward_restarts: int = Field(
        4,
        description="Reward services that died (process or actor) and were restarted (same node, same port: the "
        "generators' reward.address stays right), at most, over the run; one more death fails the run.",
        ge=0,
    )
    max_learner_restarts: int = Field(
        0,
        description="0: a learner rank that dies stops the run (the latest complete checkpoint stays resumable). "
        "N: restart the run in place from that checkpoint up to N times (ranks resumed, buffer and generators "
        "started afresh).",
        ge=0,
    )
    placement_timeout_s: float = Field(
        120.0,
        description="Longest wait for the cluster to place a role's placement group.",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    dashboard: bool = Field(True, description="Start the Ray dashboard with a local Ray (started by `tandem ray`).")
    object_store_mb: int = Field(
        0,
        description="Object store of a local Ray, in MiB (0 = Ray's default); Tandem moves no data through it.",
        ge=0,
    )
