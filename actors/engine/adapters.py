"""LoRA adapters served by a vLLM engine (learner.lora.sync = "adapter"): the engine arguments that turn vLLM's LoRA
on, an adapter-only update written as a peft adapter directory, the check that it fits the model, and the adapters an
engine holds (`Adapters`). Used by `actors.engine.vllm.VllmEngine` only; like it, written against vllm 0.32.

    engine_args = lora_engine_args(lora_rank)          # {} for 0; else enable_lora, max_lora_rank, max_loras, ...
    adapters = Adapters(llm_engine, model_path)         # one temporary directory per engine
    written, loaded = adapters.load(update)             # WeightsHeader.lora_rank > 0: write, check, add_lora
    lora = adapters.use(request_id)                     # the LoRARequest to add the request with (None: base model)
    adapters.release(request_id)                        # the request finished or was aborted
    adapters.close()

How it works: vLLM starts with LoRA on (`max_lora_rank` the smallest vLLM rank >= lora_rank, two adapters at once,
so the new one loads while requests of the old one finish) and the base weights never change. An update is written
as a peft adapter directory (adapter_model.safetensors + adapter_config.json, `write_adapter_dir`) in the engine's
temporary directory and loaded with `add_lora`; every later request is added with `LoRARequest(f"v{version}",
version + 1, dir)`. A request keeps the adapter it was added with to its end, so all its tokens are stamped with that
adapter's version (behaviour log-probs are that adapter's too), inflight or not, and nothing is paused or preempted.
An adapter no request uses any more is removed (`remove_lora`, its directory deleted). Before the first adapter,
requests sample the base model (version 0: peft's B = 0 at start). A version loaded again (a learner resumed from an
older checkpoint) gets a new directory, so the prefix cache (keyed by adapter name and path) never mixes its keys.

Failure modes: a rank over vLLM's largest raises ValueError at engine start (`lora_engine_args`, naming
learner.lora.rank). An adapter whose matrices do not fit the model's linear layers (`check_adapter_fits`: a module
the model lacks, or a shape other than A [rank, in] / B [out, rank]) and one vLLM refuses (`add_lora`) raise
`WeightsRejected`: the current adapter stays, the generator counts it. Without safetensors in the model directory
the modules are not checked (a warning at start). A full update to such an engine, or an adapter to one without
LoRA, is refused by `actors.weights.updates.check_update_kind` (`WeightsRejected` too).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from actors.weights.updates import WeightsRejected, WeightsUpdate

log = logging.getLogger("tandem.actors.adapters")


def lora_engine_args(lora_rank: int) -> dict[str, Any]:
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


class Adapters:
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
