"""Checkpoints that a crash cannot leave half-written, and resuming from the newest complete one.

    checkpoints = CheckpointManager(run_dir / "checkpoints", rank, keep=2, barrier=engine.barrier)
    path = checkpoints.latest()                       # newest complete checkpoint, or None
    state = checkpoints.load(path, trainer)           # restores engines + RNG; returns the LearnerState
    checkpoints.save(trainer, state)                  # every save_every steps, at the end, on SIGINT/SIGTERM
    trim_records(run_dir / "metrics.jsonl", state.step)   # a resume: the steps after the checkpoint go

Layout of `<run_dir>/checkpoints/step-000042/`:
    learner_state.json     step, policy_version, consumed counters (written last, by rank 0)
    rng-rank<r>.json       python, numpy and torch RNG states of rank r
    deepspeed/policy/...   DeepSpeed checkpoint of the policy (each rank its ZeRO shard); deepspeed/critic/...
    hf/                    Hugging Face export: config.json, model.safetensors, tokenizer, generation_config.json
                           (loadable by transformers and vLLM); with LoRA the merged model (W + (alpha / r) B A)
    adapter/               with LoRA only: the adapter as peft saves it (adapter_config.json,
                           adapter_model.safetensors): `PeftModel.from_pretrained(base_model, path / "adapter")`
With LoRA the DeepSpeed state holds the adapters (and the critic's value head) and their optimizer state, not the
frozen base weights: a resume loads those from the model directory again, as at the start.

Crash safety: everything is written into `step-000042.tmp/`; after every rank has finished (barrier) rank 0
renames it to `step-000042/` (one atomic rename). A directory without the `.tmp` suffix is complete; `.tmp`
directories are leftovers of a crash and are deleted when the manager starts. Only the newest `keep` complete
checkpoints are kept. Resuming needs the same world size and ZeRO stage (DeepSpeed's sharded optimizer state).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

log = logging.getLogger("tandem.learner.checkpoint")

STEP_DIR = re.compile(r"^step-(\d{6,})$")
STATE_FILE = "learner_state.json"
HF_COPIED_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
)


@dataclass
class LearnerState:
    """What the learner's loop needs to continue where it stopped (besides the engines)."""

    step: int = 0  # optimizer steps taken
    policy_version: int = 0  # the latest published version (= the step at which it was published)
    samples_trained: int = 0
    tokens_trained: int = 0
    groups_trained: int = 0

    @classmethod
    def from_json(cls, text: str) -> LearnerState:
        return cls(**{key: int(value) for key, value in json.loads(text).items()})


class Checkpointable(Protocol):
    """What a trainer offers to the checkpoint manager (the real one and the simulation)."""

    def save_state(self, directory: Path) -> None: ...

    def load_state(self, directory: Path) -> None: ...


def latest_step(root: Path) -> int | None:
    """The step of the newest complete checkpoint under `root`, or None (no folder, or none complete). Reads only:
    for a launcher, which must not clean up a learner's checkpoints as `CheckpointManager` does."""
    steps = [
        int(m.group(1))
        for p in (Path(root).iterdir() if Path(root).is_dir() else ())
        if (m := STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()
    ]
    return max(steps, default=None)


class CheckpointManager:
    """Saves and finds checkpoints under `root` (see the module docstring). `save`/`load` are collective."""

    def __init__(self, root: Path, rank: int, keep: int = 2, barrier: Callable[[], None] = lambda: None) -> None:
        """`barrier` waits for every rank (`learners.engine.barrier` with data parallelism; a no-op alone)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (got {keep})")
        self.root, self.rank, self.keep, self.barrier = Path(root), rank, keep, barrier
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for leftover in self.root.glob("step-*.tmp"):
                log.warning("removing %s: an incomplete checkpoint (the learner died while saving it)", leftover)
                shutil.rmtree(leftover, ignore_errors=True)

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [
            (int(m.group(1)), p)
            for p in self.root.iterdir()
            if (m := STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()
        ]
        return [path for _, path in sorted(found)]

    def latest(self) -> Path | None:
        found = self.complete()
        return found[-1] if found else None

    def save(self, trainer: Checkpointable, state: LearnerState) -> Path:
        """Write the checkpoint of `state.step` (replacing one of the same step) and prune old ones."""
        final = self.root / f"step-{state.step:06d}"
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.barrier()
        trainer.save_state(tmp)
        _write_atomically(tmp / f"rng-rank{self.rank}.json", json.dumps(capture_rng()))
        self.barrier()
        if self.rank == 0:
            _write_atomically(tmp / STATE_FILE, json.dumps(asdict(state), indent=2))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._prune()
            log.info("checkpoint %s saved", final)
        self.barrier()
        return final

    def load(self, path: Path, trainer: Checkpointable) -> LearnerState:
        """Restore the engines and this rank's RNG from `path`; returns the learner state saved with them."""
        if not (path / STATE_FILE).is_file():
            raise FileNotFoundError(f"{path}: not a complete checkpoint (no {STATE_FILE})")
        trainer.load_state(path)
        rng_file = path / f"rng-rank{self.rank}.json"
        if not rng_file.is_file():
            raise FileNotFoundError(f"{rng_file}: missing; was this checkpoint saved with the same world size?")
        restore_rng(json.loads(rng_file.read_text()))
        state = LearnerState.from_json((path / STATE_FILE).read_text())
        log.info("resumed from %s: step %d, policy_version %d", path, state.step, state.policy_version)
        return state

    def _prune(self) -> None:
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
            log.info("checkpoint %s deleted (keeping the last %d)", old, self.keep)


def trim_records(path: Path, last_step: int) -> int:
    """Drop from a metrics file (`common.metrics`, one JSON record with a `step` a line) the records of steps
    after `last_step`, rewriting it atomically; returns how many lines went. A learner resumed from the checkpoint
    of `last_step` trains the later steps again, so without this they would be recorded twice. A line that is not
    a record (the torn last line of a learner killed while writing it) goes too."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):  # torn or foreign: not a step of this run
            dropped += 1
            continue
        if isinstance(step, int) and step <= last_step:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        _write_atomically(path, "".join(kept))
    return dropped


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def capture_rng() -> dict[str, Any]:
    """This process's python, numpy and torch (CPU, and CUDA if present) RNG states, as JSON-able values."""
    import torch

    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(words), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng`."""
    import torch

    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        )


def export_hf_model(
    directory: Path, model_config: Any, source_dir: Path, weights: Iterable[tuple[str, Any]], write: bool
) -> None:
    """A Hugging Face directory of the current weights: config.json, model.safetensors (HF names, the training
    dtype), and the tokenizer and generation config copied from `source_dir`. Loadable by transformers and vLLM.

    `weights` is consumed on every rank (a ZeRO-3 gather is collective); only the rank with `write` copies and
    writes. Tied weights appear once (like `save_pretrained`).
    """
    tensors = {}
    for name, tensor in weights:  # every rank iterates to the end: under ZeRO-3 each item is a gather
        if write:
            tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
    if not write:
        return
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model_config.save_pretrained(str(directory))
    for name in HF_COPIED_FILES:
        if (Path(source_dir) / name).is_file():
            shutil.copy2(Path(source_dir) / name, directory / name)


SAFETENSORS_FLOATS = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
MAX_SAFETENSORS_HEADER = 100 << 20  # bytes; a longer header is no export of ours


def saved_dtype(hf_dir: Path) -> str | None:
    """The dtype of the floating-point tensors of `hf_dir/model.safetensors` (read from the file's header: no
    tensor is loaded), or None without the file, without floating tensors, or with more than one such dtype."""
    path = Path(hf_dir) / "model.safetensors"
    if not path.is_file():
        return None
    with open(path, "rb") as file:
        size = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(size)) if 0 < size <= MAX_SAFETENSORS_HEADER else {}
    found = {SAFETENSORS_FLOATS.get(spec.get("dtype")) for key, spec in header.items() if key != "__metadata__"}
    found.discard(None)
    return found.pop() if len(found) == 1 else None


def check_resume_dtype(checkpoint: Path, dtype: str, requested: str) -> None:
    """Raise ValueError when `checkpoint` was trained in another dtype than `dtype` (this learner's, resolved from
    model.dtype = `requested`): DeepSpeed's optimizer state is laid out for the dtype it was saved with (bf16
    keeps float32 master weights beside the model's, float32 none), and `auto` chooses per machine, so a run
    resumed on another kind of machine may choose otherwise. A checkpoint without an HF export passes."""
    saved = saved_dtype(Path(checkpoint) / "hf")
    if saved is not None and saved != dtype:
        chose = (
            f"model.dtype = 'auto' chose {dtype} on this machine" if requested == "auto" else f"model.dtype = {dtype}"
        )
        raise ValueError(
            f"{checkpoint} was trained in {saved}, and {chose}: a DeepSpeed checkpoint resumes only in its own "
            f"dtype; resume with --model.dtype {saved}, or start the run again without learner.resume"
        )


PEFT_PREFIX = "base_model.model."  # the key prefix of peft's adapter_model.safetensors


def export_adapter(directory: Path, peft_config: Any, weights: Iterable[tuple[str, Any]], write: bool) -> None:
    """A peft adapter directory: adapter_config.json (`peft_config`, a peft LoraConfig) and
    adapter_model.safetensors (the A and B matrices under peft's keys, `base_model.model.<module>.lora_A.weight`),
    what `PeftModel.save_pretrained` writes and `PeftModel.from_pretrained` (and vLLM's LoRA loader) reads.

    `weights` yields (contract name without the prefix, tensor) as `learners.models.adapter_weights`; it is
    consumed on every rank (a ZeRO-3 gather is collective) and only the rank with `write` writes."""
    tensors = {}
    for name, tensor in weights:
        if write:
            tensors[PEFT_PREFIX + name] = tensor.detach().to("cpu", copy=True).contiguous()
    if not write:
        return
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    peft_config.save_pretrained(str(directory))
