"""A learner resumes a checkpoint only in the dtype it was trained in (learners.checkpoint.check_resume_dtype):
model.dtype = "auto" chooses per machine, and a run resumed on another kind of machine may choose otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from learners.checkpoint import check_resume_dtype, saved_dtype


def _checkpoint(root: Path, dtypes: list[torch.dtype]) -> Path:
    (root / "hf").mkdir(parents=True)
    tensors = {f"model.layers.{i}.weight": torch.zeros(2, 3, dtype=d) for i, d in enumerate(dtypes)}
    save_file({**tensors, "model.step": torch.zeros(1, dtype=torch.int64)}, str(root / "hf" / "model.safetensors"))
    return root


def test_the_saved_dtype_is_read_from_the_export_header(tmp_path: Path) -> None:
    assert saved_dtype(_checkpoint(tmp_path / "bf16", [torch.bfloat16] * 2) / "hf") == "bfloat16"
    assert saved_dtype(_checkpoint(tmp_path / "fp32", [torch.float32]) / "hf") == "float32"
    assert saved_dtype(_checkpoint(tmp_path / "mixed", [torch.float32, torch.bfloat16]) / "hf") is None
    assert saved_dtype(tmp_path / "none") is None


def test_a_checkpoint_resumes_in_its_own_dtype_only(tmp_path: Path) -> None:
    bf16 = _checkpoint(tmp_path / "step-000004", [torch.bfloat16])
    check_resume_dtype(bf16, "bfloat16", "auto")
    check_resume_dtype(tmp_path / "no-export", "float32", "auto")  # nothing to compare: DeepSpeed decides
    with pytest.raises(
        ValueError,
        match=r"trained in bfloat16, and model.dtype = 'auto' chose float32 on this "
        r"machine: .* resume with --model.dtype bfloat16",
    ):
        check_resume_dtype(bf16, "float32", "auto")
    with pytest.raises(ValueError, match=r"trained in bfloat16, and model.dtype = float32: "):
        check_resume_dtype(bf16, "float32", "float32")
