"""C2: the stream hazard behind the learner-side NCCL stall (review finding 5), shown without a peer.

Thread B stands in for the broadcast round thread: it queues `torch.cuda._sleep` for ~`sleep_s` (cycles calibrated
against the clock: CUDA events around a known sleep), (a) on its current stream, which for a new thread is the
device's legacy default stream, the one training uses, and (b) on a dedicated `torch.cuda.Stream()`. Thread A
stands in for training: 20 bf16 matmuls + `current_stream().synchronize()`, then, separately, a device-wide
`torch.cuda.synchronize()` (what `publish` ends with).

Pass: (a) A's stream sync waits behind B's sleep (> half of it); (b) it does not (< a quarter of it over the
baseline), while the device-wide sync still waits (> half of it).
"""

from __future__ import annotations

import threading
import time
from typing import Any

CALIBRATION_CYCLES = 100_000_000  # ~50 ms at 2 GHz


def check_stream_hazard(device: str, sleep_s: float = 1.5, matmuls: int = 20, size: int = 4096) -> dict[str, Any]:
    import torch

    from benchmarks.gpu_checks.environment import device_attributes

    cycles_per_s = calibrate()
    cycles = int(sleep_s * cycles_per_s)
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    time_matmuls(a, b, matmuls)  # warm: cuBLAS handles and kernels
    baseline_s = time_matmuls(a, b, matmuls)
    default = hazard(a, b, matmuls, cycles, own_stream=False)
    own = hazard(a, b, matmuls, cycles, own_stream=True)
    clock_khz = device_attributes(0, ("ClockRate",)).get("ClockRate")
    return {
        "ok": (
            default["stream_sync_s"] > baseline_s + sleep_s / 2
            and own["stream_sync_s"] < baseline_s + sleep_s / 4
            and own["device_sync_s"] > sleep_s / 2
        ),
        "sleep_s": sleep_s,
        "cycles": cycles,
        "measured_cycles_per_s": cycles_per_s,
        "clock_rate_khz": clock_khz,
        "baseline_s": baseline_s,
        "default_stream": default,
        "own_stream": own,
        "default_stream_delay_s": default["stream_sync_s"] - baseline_s,
        "own_stream_delay_s": own["stream_sync_s"] - baseline_s,
    }


def calibrate() -> float:
    """GPU clock cycles per second as `torch.cuda._sleep` counts them (the boost clock, not the attribute's)."""
    import torch

    torch.cuda._sleep(1_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(CALIBRATION_CYCLES)
    end.record()
    end.synchronize()
    return CALIBRATION_CYCLES / (start.elapsed_time(end) / 1e3)


def time_matmuls(a: Any, b: Any, count: int) -> float:
    """Seconds for `count` matmuls on the current stream, until that stream is done."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        a @ b
    torch.cuda.current_stream().synchronize()
    return time.perf_counter() - start


def hazard(a: Any, b: Any, matmuls: int, cycles: int, own_stream: bool) -> dict[str, float]:
    """Thread B queues the sleep (on its own stream or its current one) and returns; then this thread times its
    matmuls to its stream's sync, and after that a device-wide sync."""
    import torch

    torch.cuda.synchronize()
    streams: list[Any] = []  # keeps B's stream alive until its work is done

    def thread_b() -> None:
        stream = torch.cuda.Stream() if own_stream else torch.cuda.current_stream()
        streams.append(stream)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)

    queued = threading.Thread(target=thread_b, name="stream-hazard-b")
    queued.start()
    queued.join()
    start = time.perf_counter()
    for _ in range(matmuls):
        a @ b
    torch.cuda.current_stream().synchronize()
    stream_sync_s = time.perf_counter() - start
    start = time.perf_counter()
    torch.cuda.synchronize()
    return {"stream_sync_s": stream_sync_s, "device_sync_s": time.perf_counter() - start}
