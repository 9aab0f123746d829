"""VllmEngine.load_weights on the CPU backend: after in-place loads the engine samples exactly as a fresh engine
started on the new weights (actors/engine/vllm.py, `WeightLoader`).

The tiny model has tied input/output embeddings, so this also covers the output layer following the new embedding.
Greedy decoding (temperature 0) of a few prompts, compared token for token and log-prob for log-prob: both engines
run the same kernels on the same bf16 weights in the same batches, so nothing but a different weight (or a stale
repacked layer) can change a bit. Three loads (the new weights, the old ones back, the new ones again) also check
that the reused scratch weights and rebuilt oneDNN layers carry nothing from one load into the next.

The fresh engine runs in a process of its own (tests/actors/greedy_engine.py), started first: starting a vLLM engine
is mostly one core importing and warming up, so the two engines start side by side rather than one after the other.
Its samples reach this process as JSON, which carries every float32 log-prob exactly. Both engines compute with one
thread, so they split a batch's work the same way on any machine (tests/actors/greedy_engine.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.actors.greedy_engine import engine as _engine
from tests.actors.greedy_engine import greedy as _greedy

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


def _start_fresh_engine(model_dir: Path, out: Path) -> subprocess.Popen:
    """`python -m tests.actors.greedy_engine MODEL_DIR OUT`, from the checkout's root (where `tests` imports);
    its output goes to OUT.log (files, not pipes: a full pipe would stall the engine until the test reads it)."""
    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "tests.actors.greedy_engine", str(model_dir), str(out)]
    with open(f"{out}.log", "w") as log:
        return subprocess.Popen(argv, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _update(model_dir: Path, version: int, float32: bool = False):
    import torch
    from safetensors.torch import load_file

    from actors.weights.updates import WeightsUpdate
    from common.weights import check_frames
    from launch.testing import pack_weights

    arrays, dtypes = {}, {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():  # the tiny model: bfloat16
        if float32:  # as a learner that chose float32 publishes the same weights
            arrays[name], dtypes[name] = tensor.float().numpy(), "float32"
        else:
            arrays[name], dtypes[name] = tensor.contiguous().view(torch.uint16).numpy(), "bfloat16"
    header, buckets = pack_weights(arrays, version, 1 << 20, dtypes)
    return WeightsUpdate(header, check_frames(header, [memoryview(b) for b in buckets]), time.monotonic())


def _beside_a_fresh_engine(old_dir: Path, new_dir: Path, out: Path, updates: list) -> tuple:
    """Greedy samples of an engine (model.dtype "auto") on `old_dir` before and after each of `updates`, loaded in
    order in place, and those of a fresh engine on `new_dir` started beside it in its own process:
    (before, [after each update], fresh)."""
    fresh_engine = _start_fresh_engine(new_dir, out)
    try:
        engine = _engine(old_dir)
        try:
            before, after = _greedy(engine), []
            for update in updates:
                engine.load_weights(update, inflight=False)
                assert engine.last_load_path == "in_place" and engine.policy_version == update.policy_version
                after.append(_greedy(engine))
        finally:
            engine.shutdown()
        fresh_engine.wait(timeout=300)
    finally:
        if fresh_engine.poll() is None:
            os.killpg(fresh_engine.pid, signal.SIGKILL)  # its group: vLLM's engine process with it
            fresh_engine.wait()
    assert fresh_engine.returncode == 0, Path(f"{out}.log").read_text()[-3000:]
    fresh = [(tokens, logprobs) for tokens, logprobs in json.loads(out.read_text())]
    assert [t for t, _ in before] != [t for t, _ in fresh], "the two models must sample differently to tell them apart"
    return before, after, fresh


def test_in_place_loads_in_either_dtype_sample_exactly_as_a_fresh_engine(tiny_model_dir: Path, tmp_path: Path):
    """Three loads into a model.dtype = "auto" engine: the new weights in bfloat16 (the learner's), the old ones back
    in float32, the new ones again in float32 (a learner that chose float32). The old weights back sample as before,
    bit for bit; both loads of the new weights sample exactly as a fresh engine started on them.

    "auto" is float32 where bf16 is emulated (AVX2, AVX-512 without AMX) and bfloat16 with AMX, so between the
    machines CI runs on, vLLM's weight loaders cast bfloat16 into a float32 engine and float32 into a bfloat16 one
    (actors/engine/vllm.py, Dtypes), and the bfloat16 weights' values survive both casts exactly. (This was two
    tests, each starting two engines: one with bfloat16 updates, one with a float32 engine; on the machines where
    "auto" is float32 they ran the same engines.)"""
    from common.model_prep import make_tiny_model

    new_dir = make_tiny_model(tmp_path / "seed1", seed=1)
    updates = [_update(new_dir, 1), _update(tiny_model_dir, 2, float32=True), _update(new_dir, 3, float32=True)]
    before, (from_bfloat16, back, from_float32), fresh = _beside_a_fresh_engine(
        tiny_model_dir, new_dir, tmp_path / "fresh.json", updates
    )
    assert back == before  # the old weights back: the old engine's samples, bit for bit
    assert from_bfloat16 == from_float32 == [(list(t), list(lp)) for t, lp in fresh]


def test_moe_in_place_loads_sample_exactly_as_a_fresh_engine_on_the_new_weights(tmp_path: Path) -> None:
    """A mixture-of-experts model (the tiny Mixtral: 4 experts, top-2, checkpoint names `block_sparse_moe.experts.E.
    w1/w2/w3`): its experts load through vLLM's expert weight loader into scratch weights and are prepacked again
    for the CPU kernel (actors/weights/in_place_load.py), so the engine samples bit for bit as a fresh one on the new
    weights, three loads in a row. vLLM's layerwise reload, taken before, left the experts unpacked: log-probs
    ~100x the float32 bound off (docs/models.md)."""
    from common.model_prep import resolve_model_path
    from common.tiny_models import make_tiny_family

    old_dir = resolve_model_path("tiny:mixtral")
    new_dir = make_tiny_family(tmp_path / "seed1", "mixtral", seed=1)
    updates = [_update(new_dir, 1), _update(old_dir, 2), _update(new_dir, 3)]
    before, (after_first, back, after_third), fresh = _beside_a_fresh_engine(
        old_dir, new_dir, tmp_path / "fresh.json", updates
    )
    assert back == before
    assert after_first == after_third == [(list(t), list(lp)) for t, lp in fresh]
