"""The `Engine` interface over a transformers model (tests only): what the learning tests sample with.

    engine = HfEngine(model, tokenizer, temperature=0.5, max_tokens=4)
    driver = EpisodeDriver(engine, ...)             # the production episode driver on top

Every `step()` samples ALL waiting requests to completion in one batched `generate` call (left-padded), so it has
no continuous batching; behaviour log-probs are those of the distribution sampled from (logits / temperature),
like vLLM's `processed_logprobs`. Sampling reads the model's current weights: a trainer that updates the same
module in place is sampled from at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from actors.engine.api import FinishedSample
from actors.environments.chat_turns import TokenizerTexts
from actors.weights.updates import WeightsUpdate


class HfEngine(TokenizerTexts):
    """Batched transformers sampling behind the `Engine` interface (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, temperature: float, max_tokens: int) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.temperature, self.max_tokens = temperature, max_tokens
        self.eos_id = self.turns.end_of_turn_id()
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id)
        self.policy_version = 0
        self.waiting: dict[str, tuple[list[int], int]] = {}

    def add(self, request_id: str, prompt_tokens: list[int], max_tokens: int | None = None) -> None:
        self.waiting[request_id] = (list(prompt_tokens), max_tokens or self.max_tokens)

    def num_unfinished(self) -> int:
        return len(self.waiting)

    @torch.no_grad()
    def step(self) -> list[FinishedSample]:
        requests, self.waiting = self.waiting, {}
        if not requests:
            return []
        prompts = [prompt for prompt, _ in requests.values()]
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        longest = max(limit for _, limit in requests.values())
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            temperature=self.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=longest,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[:, width:]  # [B, T]
        logprobs = torch.stack(out.logits, 1).float().div(self.temperature).log_softmax(-1)  # [B, T, V]
        logprobs = logprobs.gather(2, tokens[..., None]).squeeze(-1)  # [B, T]
        finished = []
        for row, (request_id, (_, limit)) in enumerate(requests.items()):
            ids = tokens[row, :limit].tolist()
            stopped = self.eos_id in ids
            length = ids.index(self.eos_id) + 1 if stopped else len(ids)
            finished.append(
                FinishedSample(
                    request_id,
                    np.asarray(ids[:length], np.int32),
                    logprobs[row, :length].numpy().astype(np.float32),
                    np.full(length, self.policy_version, np.int32),
                    "stop" if stopped else "length",
                    self.policy_version,
                )
            )
        return finished

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.waiting.pop(request_id, None)

    def load_weights(self, update: WeightsUpdate, inflight: bool) -> None:
        raise NotImplementedError("HfEngine samples the trainer's module in place: set policy_version instead")

    def shutdown(self) -> None:
        self.waiting.clear()
