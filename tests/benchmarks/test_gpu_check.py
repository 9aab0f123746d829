"""benchmarks/gpu_check without a GPU: its runner (one process per check with its own timeout: a check that passes,
fails, raises, hangs or dies each gets its record and the next still runs; the budget cuts and skips), its headline,
the CPU forms of its checks (the host-staged update of C5(a) delivered bit-exact, and caught when a tensor is
lost; a --device cpu run writes its records and nothing to benchmarks/results), and what it says with no CUDA.
The checks' GPU forms run only on a GPU (`python -m benchmarks.gpu_check`, see its docstring)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import benchmarks.common
from benchmarks import gpu_check
from benchmarks.gpu_check import Check

HERE = "tests.benchmarks.test_gpu_check"


# ---------------------------------------------------------------------------------------------------- fake checks
# what the runner's tests run in child processes, as function(device=..., **params)
def passing(device: str, value: int) -> dict[str, object]:
    return {"ok": True, "device": device, "value": value}


def failing(device: str) -> dict[str, object]:
    return {"ok": False, "why": "its criterion did not hold"}


def raising(device: str) -> dict[str, object]:
    raise RuntimeError("CUDA error: operation not supported")


def hanging(device: str) -> dict[str, object]:
    time.sleep(600)
    return {"ok": True}


def dying(device: str) -> dict[str, object]:
    os._exit(3)


def fake(name: str, function: str, timeout_s: float = 60, **params: object) -> Check:
    return Check(name, f"{HERE}:{function}", timeout_s, params={}, cpu_params=params)


# ---------------------------------------------------------------------------------------------------- the runner
@pytest.mark.integration
def test_each_check_gets_its_record_and_a_bad_one_does_not_stop_the_next(tmp_path: Path) -> None:
    checks = [
        fake("passes", "passing", value=7),
        fake("fails", "failing"),
        fake("raises", "raising"),
        fake("hangs", "hanging", timeout_s=2),
        fake("dies", "dying"),
        Check("gpu_only", f"{HERE}:passing", 60, params={"value": 1}),  # no CPU form: not run on the CPU
        fake("passes_after", "passing", value=8),
    ]
    started = time.monotonic()
    records = gpu_check.run_checks(checks, "cpu", tmp_path, budget_s=60)
    assert time.monotonic() - started < 30  # the hanging check cost its timeout, not its sleep
    assert list(records) == ["passes", "fails", "raises", "hangs", "dies", "passes_after"]
    assert {name: r["status"] for name, r in records.items()} == {
        "passes": "passed",
        "fails": "failed",
        "raises": "error",
        "hangs": "timeout",
        "dies": "crashed",
        "passes_after": "passed",
    }
    assert records["passes"]["figures"] == {"device": "cpu", "value": 7} and records["passes"]["ok"]
    assert records["passes_after"]["figures"]["value"] == 8
    assert records["fails"]["figures"]["why"] and not records["fails"]["ok"]
    assert records["raises"]["error"] == "RuntimeError: CUDA error: operation not supported"
    assert "Traceback" in records["raises"]["log_tail"]
    assert records["hangs"]["error"] == "killed after 2 s" and records["hangs"]["exit_code"] is None
    assert records["dies"]["exit_code"] == 3
    for name, record in records.items():  # on disk as returned, with the check's output beside it
        assert json.loads((tmp_path / f"{name}.json").read_text()) == record
        assert (tmp_path / record["log"]).is_file()


@pytest.mark.integration
def test_the_budget_bounds_each_timeout_and_skips_what_cannot_fit(tmp_path: Path) -> None:
    hangs = Check("hangs", f"{HERE}:hanging", 60, {}, {}, min_budget_s=1)
    checks = [hangs, Check("last", f"{HERE}:passing", 60, {}, {"value": 1}, min_budget_s=90)]
    records = gpu_check.run_checks(checks, "cpu", tmp_path, budget_s=3)
    assert records["hangs"]["status"] == "timeout" and records["hangs"]["timeout_s"] <= 3
    assert records["last"]["status"] == "skipped" and "needs 90" in records["last"]["error"]


def test_the_headline_is_made_from_the_records() -> None:
    def record(status: str, **figures: object) -> dict[str, object]:
        return {"status": status, "ok": status == "passed", "error": None, "figures": figures}

    checks = {
        "c0_environment": record("passed", gpu="NVIDIA H200", attributes={"HostRegisterReadOnlySupported": 0}),
        "c1a_tandem_pinned_file": record("passed", path="bounce", after_load={"kernel_raises": False}, warm_gb_s=20.0),
        "c1b_read_only_register": record("passed", after_register={"kernel_raises": True}, warm_gb_s=9.0),
        "c3d_two_ranks_host_tensors": record("failed", step_error="RuntimeError: No backend type", all_reduce_host_tensors=3),
        "c5a_staged_load": record("passed", bytes=3_000_000_000, load_s=0.3, update_s=3.0),
        "c6_d2d_yardstick": record("passed", models={"qwen2.5-1.5b": {"bytes": 3_000_000_000, "d2d_s": 0.003, "d2d_gb_s": 1000.0}}),
        "c5c_publish_cost": {"status": "skipped", "ok": False, "error": "60 s of budget left, it needs 90", "figures": {}},
    }  # fmt: skip
    headline = gpu_check.headline({"checks": checks})
    assert not headline["all_ok"] and headline["passed"] == 5 and headline["checks"] == 7
    assert headline["not_passed"] == {"c3d_two_ranks_host_tensors": "failed", "c5c_publish_cost": "skipped"}
    assert headline["host_register_read_only_supported"] == 0 and headline["tandem_staged_path"] == "bounce"
    assert headline["kernel_raises_after_tandem_load"] is False
    assert headline["kernel_raises_after_read_only_register"] is True
    assert headline["host_copy_gb_s"] == {"tandem_pinned_file": 20.0, "read_only_register": 9.0}
    assert headline["learner"] == {"c3d_two_ranks_host_tensors": "failed"}
    assert headline["two_ranks_error"].startswith("RuntimeError") and headline["two_ranks_host_tensor_all_reduces"] == 3
    assert headline["d2d_gb_s"] == 1000.0 and headline["staged_load_gb_s"] == pytest.approx(10.0)
    assert headline["staged_load_over_d2d"] == pytest.approx(100.0) and headline["staged_update_s"] == 3.0
    assert "publish_snapshot_s" not in headline and "ipc_load_s" not in headline  # not measured: not made up
    assert gpu_check.headline({"checks": {}})["all_ok"] is False


# ---------------------------------------------------------------------------------------------------- CPU forms
def test_the_staged_load_delivers_every_byte_on_cpu_and_a_lost_tensor_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import actors.weights.cuda
    from benchmarks.gpu_checks import weights_paths

    result = weights_paths.check_staged_load("cpu", "tiny-qwen2", updates=2)
    assert result["ok"] and result["path"] == "pageable"  # nothing to pin for a CPU receiver
    assert [row["equal"] and row["head_equals_embedding"] and row["head_shipped"] for row in result["updates"]] == [
        True,
        True,
    ]

    load = actors.weights.cuda.load_staged_pinned
    monkeypatch.setattr(
        actors.weights.cuda, "load_staged_pinned", lambda runner, path, tensors: load(runner, path, tensors[:-1])
    )
    lossy = weights_paths.check_staged_load("cpu", "tiny-qwen2", updates=1)
    assert not lossy["ok"] and not lossy["updates"][0]["equal"]


@pytest.mark.integration
def test_a_cpu_run_writes_its_records_and_nothing_to_the_results(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path / "results")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_code:
        gpu_check.main(["--device", "cpu", "--out", str(out), "--only", "c0_environment,c1a_tandem_pinned_file"])
    assert exit_code.value.code == 0
    result = json.loads((out / "gpu_check.json").read_text())
    assert list(result["checks"]) == ["c0_environment", "c1a_tandem_pinned_file"]
    assert result["headline"] == gpu_check.headline(result) and result["headline"]["all_ok"]
    pinned_file = json.loads((out / "c1a_tandem_pinned_file.json").read_text())["figures"]
    assert pinned_file["bytes_equal"] and not pinned_file["after_load"]["kernel_raises"]
    assert not (tmp_path / "results").exists()


def test_without_cuda_it_says_so_and_writes_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the machine without CUDA")
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path / "results")
    gpu_check.main(["--out", str(tmp_path / "out")])
    said = capsys.readouterr().out
    assert "needs a GPU" in said and "c5b_ipc_load" in said  # and what it would have run
    assert not (tmp_path / "results").exists() and not (tmp_path / "out").exists()
