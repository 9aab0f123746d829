"""The interface a generator drives: a continuously batching sampling engine (vLLM, or the simulation stand-in).

    engine.add(request_id, prompt_tokens)           # any time: joins the running batch at the next step
    engine.add(request_id, prompt_tokens, max_tokens=16)    # a turn of a multi-turn episode: its own budget
    engine.add(request_id, prompt_tokens, temperature=0.0)  # an eval request: greedy (0), or its own temperature
    while engine.num_unfinished():
        for sample in engine.step():                # one engine step; the samples that finished in it
            ...                                     # sample.token_versions says which weights made each token
    engine.load_weights(update, inflight=False)     # between steps; stamps later tokens with update.policy_version

Implementations: `actors.engine.vllm.VllmEngine` (with actors/engine/adapters.py the only modules that call vLLM) and
`actors.engine.simulated.SimEngine` (SIMULATION: random tokens at a configured cost per step); `open_engine(config)`
builds the one a run config asks for (importing it only then).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from actors.weights.updates import WeightsUpdate
from common.config import TandemConfig
from common.types import PromptItem

log = logging.getLogger("tandem.actors.engine_api")

TRAINING_PRIORITY = 0  # `Engine.add(priority=...)`: training samples first ...
EVAL_PRIORITY = 1  # ... evaluation (actors.evaluation) in the batch slots they leave free


@dataclass(frozen=True)
class SamplingSettings:
    """What every request of a generator is sampled with (from `GeneratorConfig` and `AlgoConfig`)."""

    temperature: float
    top_p: float
    max_tokens: int
    seed: int


@dataclass(frozen=True)
class FinishedSample:
    """One completed (or aborted) sample. Arrays are aligned: token i was sampled with log-prob
    `behaviour_logprobs[i]` (under the distribution it was actually drawn from) by weights `token_versions[i]`."""

    request_id: str
    completion_tokens: np.ndarray  # int32 [T]
    behaviour_logprobs: np.ndarray  # float32 [T]
    token_versions: np.ndarray  # int32 [T]
    finish_reason: str  # "stop" (end of sequence) or "length" (max_tokens)
    start_version: int  # policy_version of the weights that made its first token (at `add`, for an empty one)


class Engine(Protocol):
    """A sampling engine with continuous batching. Not thread-safe: one driver thread.

    Invariants: every request added is returned by `step()` exactly once, unless `abort`ed (then never);
    `policy_version` changes only inside `load_weights`.
    """

    policy_version: int

    def render(self, prompt: PromptItem) -> list[int]:
        """Prompt token ids of a leased chat (the model's chat template, with the generation prompt)."""
        ...

    def decode(self, tokens: np.ndarray) -> str:
        """Text of completion tokens (special tokens skipped), for the reward function."""
        ...

    def render_turn(self, model_tokens: np.ndarray, messages: list[dict[str, str]]) -> list[int]:
        """Environment tokens that follow a model turn in a multi-turn episode: the end of the model's turn that it
        did not sample itself, then `messages`, then the generation prompt (see `actors.environments.chat_turns`)."""
        ...

    def add(
        self,
        request_id: str,
        prompt_tokens: list[int],
        max_tokens: int | None = None,
        temperature: float | None = None,
        priority: int = TRAINING_PRIORITY,
    ) -> None:
        """Queue one sample of at most `max_tokens` tokens (None = the engine's configured `max_tokens`) at
        `temperature` (None = the engine's configured one; 0 = greedy decoding, top-p off); it joins the running
        batch at the next step. `behaviour_logprobs` are under the distribution the request was sampled from.
        `priority`: a free batch slot goes to the waiting request of the lowest value first (arrival order among
        equals); evaluation asks with EVAL_PRIORITY, so it only takes the slots training leaves free."""
        ...

    def num_unfinished(self) -> int:
        """Requests added and not yet returned by `step()`."""
        ...

    def step(self) -> list[FinishedSample]:
        """Run (or wait for) one engine step; returns the samples that finished. Call only while
        `num_unfinished() > 0`."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Drop these requests (unknown ids are ignored); `step()` will not return them."""
        ...

    def load_weights(self, update: WeightsUpdate, inflight: bool) -> None:
        """Replace the weights and set `policy_version = update.policy_version`. `inflight=False` requires
        `num_unfinished() == 0` (the caller drains first); `inflight=True` keeps running samples, whose later
        tokens are stamped with the new version (with adapters, `lora_rank` > 0, a running sample keeps the adapter
        it was added with, and its version, to its end). Raises `actors.weights.updates.WeightsRejected`, changing nothing,
        for an update of the wrong kind (full or adapter-only) or an adapter that does not fit the model; raises
        otherwise on a layout the model does not accept."""
        ...

    def shutdown(self) -> None:
        """Stop the engine and its worker processes (idempotent)."""
        ...


def adapter_rank(config: TandemConfig) -> int:
    """The adapter rank the engine serves: learner.lora.rank with learner.lora.sync = "adapter" (adapter-only
    updates; the config refuses them over weights.transport = "broadcast"), else 0 (full weights, merged or not)."""
    lora = config.learner.lora
    return lora.rank if lora.sync == "adapter" else 0


def open_engine(config: TandemConfig) -> Engine:
    """The SIMULATION engine when `run.simulate`, else vLLM on the configured model (CPU knobs set first); with
    LoRA enabled for adapter-only updates when `adapter_rank(config)` > 0."""
    gen = config.generator
    max_num_seqs = gen.prompts_in_flight * config.algo.group_size
    seed = config.run.seed + gen.index
    lora_rank = adapter_rank(config)
    if config.run.simulate:
        from actors.engine.simulated import SimEngine

        return SimEngine(gen.sim_tokens, gen.sim_token_s, max_num_seqs, seed, lora_rank)
    from actors.engine.vllm import VllmEngine, configure_cpu_environment
    from common.model_prep import resolve_model_path

    log.info("engine environment: %s", configure_cpu_environment(gen))
    settings = SamplingSettings(gen.temperature, gen.top_p, gen.max_tokens, seed)
    model_path = resolve_model_path(config.model.path)
    return VllmEngine(
        model_path,
        config.model,
        settings,
        max_num_seqs,
        gen.enforce_eager,
        gen.tensor_parallel_size,
        lora_rank,
        gen.gpu_memory_utilization,
        broadcast=config.weights.transport == "broadcast",
    )
