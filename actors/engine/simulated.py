"""SIMULATION stand-in for vLLM (`run.simulate = true`): the `Engine` interface with a configured cost and no model.

Every step produces one random token for every running sequence and takes `sim_token_s` of wall time however many
sequences run (continuous batching: a step's cost does not grow with the batch); a sample finishes after
`sim_tokens` tokens (or the request's own `max_tokens`, if fewer). Weights are received for real by the generator
(same transport, same bytes) and "loaded" by taking their version: there is no model to load them into. With
`lora_rank` > 0 (learner.lora.sync = "adapter") it takes adapter-only updates as vLLM does (actors/engine/vllm.py): a
request keeps the version it was added with to its end, inflight or not, and the kind of update is checked
(`check_update_kind`: a full update raises `WeightsRejected`, as an adapter does without `lora_rank`). Prompts
and multi-turn observations are "tokenized" as their UTF-8 bytes.
Everything around it (leases, sockets, buffer, versions, staleness) stays real; this is what fleet-scale tests use.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from actors.engine.api import TRAINING_PRIORITY, FinishedSample
from actors.weights.updates import WeightsUpdate, check_update_kind
from common.types import PromptItem

log = logging.getLogger("tandem.actors.sim_engine")

SIM_VOCAB_SIZE = 49152
SIM_END_OF_TURN = 2  # what closes an assistant turn in `render_turn` (a random token is it 1 time in 49152)


@dataclass
class _SimSequence:
    request_id: str
    start_version: int
    length: int  # tokens it finishes after
    priority: int = TRAINING_PRIORITY
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


class SimEngine:
    """SIMULATION: a continuously batching engine that generates random tokens (see the module docstring)."""

    def __init__(self, sim_tokens: int, sim_token_s: float, max_num_seqs: int, seed: int, lora_rank: int = 0) -> None:
        self.sim_tokens = sim_tokens
        self.lora_rank = lora_rank  # > 0: adapter-only updates (a request samples with the adapter it was added with)
        self.sim_token_s = sim_token_s
        self.max_num_seqs = max_num_seqs
        self.rng = np.random.default_rng(seed)
        self.policy_version = 0
        self.waiting: deque[_SimSequence] = deque()  # in arrival order; a free slot takes the lowest priority first
        self.running: dict[str, _SimSequence] = {}
        log.info("SIMULATION engine: %d random tokens a sample, %.4fs a step (no model)", sim_tokens, sim_token_s)

    def render(self, prompt: PromptItem) -> list[int]:
        text = "\n".join(f"{m['role']}: {m['content']}" for m in prompt.messages)
        return list(text.encode())

    def decode(self, tokens: np.ndarray) -> str:
        return " ".join(str(int(t)) for t in tokens)

    def render_turn(self, model_tokens: np.ndarray, messages: list[dict[str, str]]) -> list[int]:
        """The end-of-turn token (unless sampled), then each message and `assistant: ` as UTF-8 bytes."""
        ended = len(model_tokens) > 0 and int(model_tokens[-1]) == SIM_END_OF_TURN
        text = "".join(f"\n{m['role']}: {m['content']}" for m in messages) + "\nassistant: "
        return ([] if ended else [SIM_END_OF_TURN]) + list(text.encode())

    def add(
        self,
        request_id: str,
        prompt_tokens: list[int],
        max_tokens: int | None = None,
        temperature: float | None = None,
        priority: int = TRAINING_PRIORITY,
    ) -> None:
        """`temperature` is accepted and ignored: the tokens are random whatever it is. `priority` orders the
        waiting requests as vLLM's priority scheduler does (lower first, arrival order among equals)."""
        length = self.sim_tokens if max_tokens is None else max(1, min(self.sim_tokens, max_tokens))
        self.waiting.append(_SimSequence(request_id, self.policy_version, length, priority))

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def step(self) -> list[FinishedSample]:
        while self.waiting and len(self.running) < self.max_num_seqs:
            sequence = min(self.waiting, key=lambda s: s.priority)  # the first of the lowest priority
            self.waiting.remove(sequence)
            self.running[sequence.request_id] = sequence
        if not self.running:
            return []
        time.sleep(self.sim_token_s)  # the cost of one batched decode step
        tokens = self.rng.integers(0, SIM_VOCAB_SIZE, size=len(self.running))
        logprobs = -self.rng.exponential(2.0, size=len(self.running))
        finished = []
        for sequence, token, logprob in zip(list(self.running.values()), tokens, logprobs):
            sequence.tokens.append(int(token))
            sequence.logprobs.append(float(logprob))
            sequence.versions.append(sequence.start_version if self.lora_rank else self.policy_version)
            if len(sequence.tokens) >= sequence.length:
                del self.running[sequence.request_id]
                finished.append(
                    FinishedSample(
                        sequence.request_id,
                        np.asarray(sequence.tokens, dtype=np.int32),
                        np.asarray(sequence.logprobs, dtype=np.float32),
                        np.asarray(sequence.versions, dtype=np.int32),
                        "length",
                        sequence.start_version,
                    )
                )
        return finished

    def abort(self, request_ids: list[str]) -> None:
        dropped = set(request_ids)
        self.waiting = deque(s for s in self.waiting if s.request_id not in dropped)
        for request_id in dropped:
            self.running.pop(request_id, None)

    def load_weights(self, update: WeightsUpdate, inflight: bool) -> None:
        if self.num_unfinished() and not inflight:
            raise RuntimeError(f"load_weights(inflight=False) with {self.num_unfinished()} samples running")
        check_update_kind(update.header, self.lora_rank)
        self.policy_version = update.policy_version

    def shutdown(self) -> None:
        self.waiting.clear()
        self.running.clear()
