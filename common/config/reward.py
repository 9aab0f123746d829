"""`[reward]`: the reward service (a reward model in its own process)."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
)

from common.config.base import MAX_TIMEOUT_S, Address, CoreList, Host, _Section


class RewardConfig(_Section):
    """The reward service (`tandem reward`, actors/rewards/service.py): env.reward_model scored for the generators,
    a whole group per request, batched. Used only when env.reward_model is set."""

    host: Host = Field(
        "127.0.0.1",
        description="Address the reward service binds (loopback by default; any other needs run.curve_keys_dir or "
        "run.insecure).",
    )
    port: int = Field(
        5559, description="Port of the reward service (unset: run.port_base + 4, else 5559).", ge=1, le=65535
    )
    address: Address = Field(
        "127.0.0.1:5559",
        description="host:port the generators reach the reward service at. Unset: reward.host:reward.port "
        "(127.0.0.1 for a wildcard host); write it when the service runs on another machine.",
    )
    in_process: bool = Field(
        False,
        description="Score inside each generator (its own copy of the model, on the CPU, no service): for small "
        "reward models. The service scores on the first CUDA device when its node has one.",
    )
    weight: float = Field(1.0, description="Weight of the `reward_model` component in the scalar reward.", ge=0)
    normalize: bool = Field(
        False,
        description="Give (score - mean) / std, with the running mean and std of every score the scorer has given "
        "(the first score: 0). Raw scores drift with the model; normalised ones keep the reward's scale.",
    )
    batch_size: int = Field(32, description="Sequences in one forward pass of the reward model.", ge=1, le=4096)
    timeout_s: float = Field(
        60.0,
        description="Longest wait for one group's scores; past it (or while the service is down) the group's "
        "`reward_model` component is env.fallback_reward, counted (actor/reward_model_fallbacks) and logged, and "
        "the generator keeps going (it reconnects by itself).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "float32",
        description="Dtype the reward model scores in (float32: batched and one-by-one scores agree; `auto`: "
        "chosen on the scorer's machine as model.dtype's `auto`).",
    )
    cpu_cores: CoreList = Field(
        "", description="Cores the reward service is pinned to, written as generator.cpu_cores (empty = all)."
    )
