"""Shared fixtures. Heavy engines are started by the tests that need them, never at import time."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launch.testing import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama model with SmolLM2's tokenizer (built once per test session, a few seconds)."""
    from common.model_prep import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture
def ports() -> tuple[int, int]:
    """Two free loopback ports: (buffer, weights)."""
    return free_port(), free_port()
