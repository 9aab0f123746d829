"""model.dtype = "auto" (common.dtypes): the choice from simulated CPU flags and a simulated GPU, an explicit dtype
kept, the one-time warning for bf16 on a CPU that emulates it, the config value and what `tandem config` says.
Nothing here reads this machine's CPU: every flag set is written out (the CLI's is patched)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from common import dtypes
from common.config import ConfigError, ModelConfig, load_config
from common.dtypes import choose_dtype, machine_summary, read_cpu_flags, resolve_dtype

AVX2_ONLY = frozenset({"fpu", "sse2", "sse4_2", "avx", "fma", "avx2", "bmi2"})  # AMD EPYC Zen 1
AVX512_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}  # AMD Zen 4, Intel Cooper Lake
AMX = AVX2_ONLY | {"avx512f", "amx_tile", "amx_int8", "amx_bf16"}  # Intel Sapphire Rapids (flags as listed)
AVX512_NO_BF16 = AVX2_ONLY | {"avx512f", "avx512bw"}  # Intel Skylake-SP


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtypes, "_warned", set())  # each test sees a process that has warned about nothing


@pytest.mark.parametrize(
    ("flags", "dtype", "reason"),
    [
        (AVX2_ONLY, "float32", "this CPU has avx2 but no avx512_bf16/amx_bf16 (bf16 would be emulated)"),
        (AVX512_NO_BF16, "float32", "this CPU has avx512f but no avx512_bf16/amx_bf16 (bf16 would be emulated)"),
        # native but no faster than float32 without AMX (measured: GEMM 69.9 vs 113.1 GFLOP/s, see common.dtypes)
        (AVX512_BF16, "float32", "this CPU has avx512_bf16 but no amx_bf16 (bf16 is native but no faster"),
        (AMX, "bfloat16", "this CPU has amx_bf16 (bf16 computed natively, on AMX tiles)"),
        (frozenset(), "float32", "this CPU's flags cannot be read"),
    ],
    ids=["avx2-only", "avx512-without-bf16", "avx512-bf16", "amx", "unreadable"],
)
def test_auto_on_the_cpu_is_bf16_only_where_the_cpu_computes_it_faster(flags: frozenset[str], dtype: str, reason: str):
    choice = resolve_dtype("auto", flags, cuda_bf16=None)
    assert (choice.dtype, choice.emulated) == (dtype, False)
    assert choice.reason.startswith(reason)


def test_auto_on_a_gpu_follows_the_gpu_not_the_cpu() -> None:
    """A role computing on a CUDA device: its capability decides (the host CPU's flags do not matter)."""
    ampere = resolve_dtype("auto", AVX2_ONLY, cuda_bf16=True)  # compute capability 8.0+ (A100, H100, ...)
    assert ampere.dtype == "bfloat16" and "compute capability >= 8.0" in ampere.reason
    turing = resolve_dtype("auto", AMX, cuda_bf16=False)  # 7.5 (T4): bf16 only emulated
    assert turing.dtype == "float32" and "compute capability < 8.0" in turing.reason


@pytest.mark.parametrize("flags", [AVX2_ONLY, AVX512_BF16, AMX])
@pytest.mark.parametrize("cuda_bf16", [None, True, False])
@pytest.mark.parametrize("explicit", ["bfloat16", "float32"])
def test_an_explicit_dtype_is_kept_everywhere(flags: frozenset[str], cuda_bf16: bool | None, explicit: str) -> None:
    choice = resolve_dtype(explicit, flags, cuda_bf16)
    assert choice.dtype == explicit and choice.describe().startswith(f"model.dtype {explicit} (explicit): ")
    emulating_cpu = cuda_bf16 is None and flags == AVX2_ONLY
    assert choice.emulated == (explicit == "bfloat16" and emulating_cpu)


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="auto, bfloat16, float32"):
        resolve_dtype("float16", AMX, None)


def test_the_choice_is_logged_with_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tandem.dtype"):
        assert choose_dtype("auto", None, cpu_flags=AVX2_ONLY).dtype == "float32"
    assert caplog.messages == [
        "model.dtype auto -> float32: this CPU has avx2 but no avx512_bf16/amx_bf16 (bf16 would be emulated)"
    ]


def test_bf16_asked_for_on_an_emulating_cpu_is_warned_about_once_with_the_cost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="tandem.dtype"):
        for _ in range(3):
            assert choose_dtype("bfloat16", None, cpu_flags=AVX2_ONLY).dtype == "bfloat16"  # kept
        choose_dtype("bfloat16", None, key="reward.dtype", cpu_flags=AVX2_ONLY)  # another key: its own warning
        choose_dtype("bfloat16", None, cpu_flags=AMX)  # native: no warning
        choose_dtype("bfloat16", True, cpu_flags=AVX2_ONLY)  # on a GPU: the CPU does not compute it
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and warnings[0].startswith("model.dtype = bfloat16 on a CPU without")
    assert "16 tok/s in bfloat16 vs 73 in float32" in warnings[0] and "1.0 vs 31.3 GFLOP/s" in warnings[0]
    assert warnings[1].startswith("reward.dtype = bfloat16")


def test_cpu_flags_are_read_from_the_flags_line(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7551\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\n")
    assert read_cpu_flags(cpuinfo) == {"fpu", "avx2", "fma"}
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert read_cpu_flags(tmp_path / "arm") == frozenset()  # no x86 flags: auto is float32
    assert read_cpu_flags(tmp_path / "missing") == frozenset()


def test_auto_is_the_default_and_the_config_accepts_only_the_three_values(tmp_path: Path) -> None:
    assert ModelConfig().dtype == "auto"
    path = tmp_path / "run.toml"
    for value in ("auto", "bfloat16", "float32"):
        path.write_text(f'[model]\ndtype = "{value}"\n')
        assert load_config(path, []).model.dtype == value
    path.write_text('[model]\ndtype = "float16"\n')
    with pytest.raises(ConfigError, match="model.dtype: Input should be 'auto', 'bfloat16' or 'float32'"):
        load_config(path, [])


def test_the_demo_config_uses_auto() -> None:
    from launch.cli import DEMO_CONFIG

    assert load_config(DEMO_CONFIG, []).model.dtype == "auto"


def test_machine_summary_says_the_choice_and_warns_for_emulated_bf16() -> None:
    auto = machine_summary("auto", AVX2_ONLY)
    assert auto.startswith("model.dtype auto -> float32: this CPU has avx2 but no avx512_bf16/amx_bf16")
    assert "each role chooses on its own machine" in auto and "\n" not in auto
    assert machine_summary("auto", AMX).startswith("model.dtype auto -> bfloat16: this CPU has amx_bf16")
    explicit = machine_summary("bfloat16", AVX2_ONLY).splitlines()
    assert explicit[0].startswith("model.dtype bfloat16 (explicit)")
    assert explicit[1].startswith("warning: model.dtype = bfloat16 on a CPU without avx512_bf16/amx_bf16")


def test_tandem_config_prints_this_machines_choice_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """stdout stays the resolved config as JSON (what scripts read); the dtype line goes to stderr."""
    import json

    from launch import cli

    monkeypatch.setattr(dtypes, "read_cpu_flags", lambda path=None: AVX2_ONLY)
    assert cli.main(["config", "demo", "--no-path-checks"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["model"]["dtype"] == "auto"
    assert "model.dtype auto -> float32: this CPU has avx2 but no avx512_bf16/amx_bf16" in err
    assert cli.main(["config", "demo", "--no-path-checks", "--model.dtype", "bfloat16"]) == 0
    assert "warning: model.dtype = bfloat16 on a CPU without" in capsys.readouterr().err
