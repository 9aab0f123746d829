r"""Issue 31's GPU checks C0-C6 on one lent GPU (an H200), without vLLM, each in its own process: <= 8 min.

    check                            what it runs (benchmarks/gpu_checks/<module>)                    passes when
    c0_environment                   versions, GPU, /dev/shm, host-register attributes (environment)   it ran
    c1a_tandem_pinned_file           actors.weights.cuda as it is now + a kernel after (host_memory)   no kernel raises
    c1b..e                           read-only register / COW register / pinned bounce / pageable      bytes arrive
    c2_stream_hazard                 a 1.5 s sleep on another thread's default vs own stream (streams) as predicted
    c3a..d                           Trainer.train_step: padded ZeRO-1 + KL, packed vs padded,         finite, moved,
                                     ZeRO-3 + checkpointing, world_size patched to 2 (learner)         no skips
    c4_generator_memory              a second process's context + full bucket set, 1.5B, 4B (memory)   it ran
    c5a_staged_load, c5b_ipc_load    load_staged_pinned / load_ipc x5 at Qwen2.5-1.5B (weights_paths)  bit-exact
    c6_d2d_yardstick                 a device-to-device copy of the model's bytes (weights_paths)      it ran
    c5c_publish_cost                 copy_into_snapshot vs copy_into_buckets (weights_paths)           same bytes

The review that designed them (gpu-path-review.md, "A GPU check for one H200") gives each check's finding; each
module's docstring says what its check measures and why its criterion is what it is.

Rules: every check is a child process (`python -m benchmarks.gpu_check --child module:function`) with its own
timeout, so a CUDA error left pending by one (review finding 4) or a hang cannot reach the next; a check that
times out is killed with its process group. The whole run has `--budget-s` (450 s): a check gets at most what is
left, and c5c_publish_cost, last, is skipped with less than 90 s left. Each check writes one record,
`<out>/<check>.json`: status (passed, failed, error, timeout, crashed, skipped), ok, error, seconds, figures;
its output goes to `<out>/<check>.log`. The combined result, with a `headline` (made from the records by
`headline()`), is `<out>/gpu_check.json` and, on CUDA, benchmarks/results/gpu_check.json (`benchmarks.common.save`).
The exit code is 0 when every check passed, else 1 (c3d failed before learners.engine.all_reduce moved host
tensors to the device for NCCL: review finding 1).

Without CUDA it says so, lists what it would run, and exits 0, writing nothing. `--device cpu` runs the checks
that have a CPU form (smaller sizes; records in --out only, never in benchmarks/results): the tests use it.
(`learners.engine.init_distributed` keeps DeepSpeed from compiling its shared-memory op on a CPU, so no check
waits on that build or its lock.)

The lent machine has CUDA torch, transformers, numpy and msgpack, but not pyzmq, pydantic or deepspeed (imported by
the modules checked: c0, c1b-e, c2, c4 need none of them), and reaches no registry: carry them (22 MB of the
64 MiB allowed), copied from this checkout's .venv (their binaries are CPython 3.11's: the command below prints the
lent machine's version first; for another one, `pip download` the same versions for it instead). Here, once:

    mkdir -p gpu_site && (cd .venv/lib/python3.11/site-packages && cp -r deepspeed deepspeed-0.19.8.dist-info \
        zmq pyzmq.libs pyzmq-27.3.0.dist-info pydantic pydantic-2.14.4.dist-info pydantic_core \
        pydantic_core-2.50.5.dist-info annotated_types typing_inspection hjson cpuinfo einops ../../../../gpu_site/)
    find gpu_site -name __pycache__ -prune -exec rm -rf {} +
    echo gpu_site/ >> .git/info/exclude                   # `run` carries ignored paths only

then on the device (the `run` tool, carry=["gpu_site"], timeout_s=540):

    python -V && PYTHONPATH=gpu_site python -m benchmarks.gpu_check --out $OUT

Here (no GPU):

    python -m benchmarks.gpu_check --help
    python -m benchmarks.gpu_check --device cpu --out /tmp/gpu_check --only c0_environment,c5a_staged_load
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUDGET_S = 450.0  # the whole run, under 8 minutes with the parent's own start
MIN_BUDGET_S = 5.0  # a check is skipped with less left than this (or than its own min_budget_s)
LOG_TAIL_CHARS = 3000  # of a check's output, in its record when it did not pass


@dataclass(frozen=True)
class Check:
    """One check: `target` ("module:function") is called in a child process as function(device=..., **params)
    and returns its figures with "ok". `cpu_params` None: a GPU-only check."""

    name: str
    target: str
    timeout_s: float
    params: dict[str, Any] = field(default_factory=dict)
    cpu_params: dict[str, Any] | None = None
    min_budget_s: float = MIN_BUDGET_S

    def params_for(self, device: str) -> dict[str, Any] | None:
        return self.params if device == "cuda" else self.cpu_params


def _in(module: str, function: str) -> str:
    return f"benchmarks.gpu_checks.{module}:{function}"


FILE_GPU, FILE_CPU = {"size_mib": 2048}, {"size_mib": 64}  # C1's staged file
LEARNER_GPU, LEARNER_CPU = {"shape": "learner-qwen2"}, {"shape": "tiny-qwen2"}
QWEN_GPU, QWEN_CPU = {"shape": "qwen2.5-1.5b"}, {"shape": "tiny-qwen2"}
MEMORY_GPU = {"shapes": ["qwen2.5-1.5b", "qwen3-4b"]}
D2D_GPU, D2D_CPU = {"shapes": ["qwen2.5-1.5b", "tinyllama-1.1b"]}, {"shapes": ["tiny-qwen2"]}
PLAN = [  # in running order: (name, target, timeout_s, GPU params, CPU params or None: GPU only)
    Check("c0_environment", _in("environment", "check_environment"), 30, {}, {}),
    Check("c1a_tandem_pinned_file", _in("host_memory", "check_tandem_pinned_file"), 45, FILE_GPU, FILE_CPU),
    Check("c1b_read_only_register", _in("host_memory", "check_read_only_register"), 40, FILE_GPU),
    Check("c1c_copy_on_write_register", _in("host_memory", "check_copy_on_write_register"), 40, FILE_GPU),
    Check("c1d_pinned_bounce_buffer", _in("host_memory", "check_bounce_buffer"), 40, FILE_GPU, FILE_CPU),
    Check("c1e_pageable", _in("host_memory", "check_pageable"), 40, FILE_GPU, FILE_CPU),
    Check("c2_stream_hazard", _in("streams", "check_stream_hazard"), 40, {"sleep_s": 1.5}),
    Check("c3a_padded_zero1_kl", _in("learner", "check_padded"), 100, LEARNER_GPU, LEARNER_CPU),
    Check("c3b_packed_against_padded", _in("learner", "check_packed"), 100, LEARNER_GPU, LEARNER_CPU),
    Check("c3c_zero3_checkpointing", _in("learner", "check_zero3_checkpointing"), 100, LEARNER_GPU, LEARNER_CPU),
    Check("c3d_two_ranks_host_tensors", _in("learner", "check_two_ranks"), 100, LEARNER_GPU, LEARNER_CPU),
    Check("c4_generator_memory", _in("memory", "check_generator_memory"), 45, MEMORY_GPU),
    Check("c5a_staged_load", _in("weights_paths", "check_staged_load"), 90, QWEN_GPU, QWEN_CPU),
    Check("c5b_ipc_load", _in("weights_paths", "check_ipc_load"), 120, QWEN_GPU),
    Check("c6_d2d_yardstick", _in("weights_paths", "check_d2d_copy"), 30, D2D_GPU, D2D_CPU),
    Check("c5c_publish_cost", _in("weights_paths", "check_publish_cost"), 90, QWEN_GPU, QWEN_CPU, min_budget_s=90),
]


# ---------------------------------------------------------------------------------------------------- the runner
def run_checks(checks: list[Check], device: str, out: Path, budget_s: float) -> dict[str, dict[str, Any]]:
    """Run each check that has a form for `device` in its own process, in order, within `budget_s` in all;
    returns {name: record}, each also written to `out/<name>.json`."""
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    records = {}
    for check in checks:
        params = check.params_for(device)
        if params is None:
            continue
        left = deadline - time.monotonic()
        if left < check.min_budget_s:
            record = {
                "status": "skipped",
                "ok": False,
                "error": f"{left:.0f} s of budget left, it needs {check.min_budget_s:.0f}",
            }
            record.update(check=check.name, seconds=0.0, figures={})
        else:
            record = run_check(check, device, params, out, min(check.timeout_s, left))
        (out / f"{check.name}.json").write_text(json.dumps(record, indent=2, default=str))
        print(f"[{check.name}] {record['status']} in {record['seconds']:.1f} s{describe(record)}", flush=True)
        records[check.name] = record
    return records


def run_check(check: Check, device: str, params: dict[str, Any], out: Path, timeout_s: float) -> dict[str, Any]:
    """One check in a child process of its own group, killed with the group past `timeout_s`. The child writes
    its record; a child that wrote none (killed, crashed) gets one saying so, with the tail of its log."""
    record_path, log_path = out / f"{check.name}.json", out / f"{check.name}.log"
    record_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--child", check.target, "--device", device]
    command += ["--params", json.dumps(params), "--record", str(record_path)]
    started = time.monotonic()
    with open(log_path, "wb") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            exit_code: int | None = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            exit_code = None
        end_group(child)
    record = read_record(record_path)
    if record is None:
        status = "timeout" if exit_code is None else "crashed"
        reason = f"killed after {timeout_s:.0f} s" if exit_code is None else f"exited {exit_code} without a record"
        record = {"status": status, "ok": False, "error": reason, "figures": {}}
    record.update(check=check.name, seconds=time.monotonic() - started, timeout_s=timeout_s, exit_code=exit_code)
    record["log"] = log_path.name
    if record["status"] != "passed":
        record["log_tail"] = log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
    return record


def end_group(child: subprocess.Popen) -> None:
    """Kill what is left of the check's process group (the check itself past its timeout, or a child of its
    own it left behind), then reap the check."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone: nothing was left
    child.wait()


def read_record(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def describe(record: dict[str, Any]) -> str:
    return f": {record['error']}" if record.get("error") else ""


def run_child(target: str, device: str, params: dict[str, Any], record_path: Path) -> int:
    """The child's side: call the check, write its record (an exception becomes an "error" record: the runner
    goes on with the next check). Returns the exit code: 0 when it passed."""
    module, function = target.split(":")
    started = time.perf_counter()
    try:
        figures = getattr(importlib.import_module(module), function)(device=device, **params)
        ok = bool(figures.pop("ok"))
        record = {"status": "passed" if ok else "failed", "ok": ok, "error": None, "figures": figures}
    except Exception as error:  # noqa: BLE001 - recorded with its trace, which the log also shows
        traceback.print_exc()
        message = f"{type(error).__name__}: {error}"
        record = {
            "status": "error",
            "ok": False,
            "error": message[:2000],
            "trace": traceback.format_exc(),
            "figures": {},
        }
    record["check_s"] = time.perf_counter() - started
    partial = record_path.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=2, default=str))
    partial.replace(record_path)
    return 0 if record["ok"] else 1


# ---------------------------------------------------------------------------------------------------- the result
def figures_of(result: dict[str, Any], check: str, *keys: str) -> Any:
    """result's checks[check].figures[keys[0]][keys[1]]...; None where any is missing."""
    value: Any = result["checks"].get(check, {}).get("figures")
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures issues quote, made from the records alone: which checks passed, what Tandem's host-staged load
    did, the stall, the learner's variants, the generator's memory, and each weights path in GB/s and over the
    device-to-device copy of the same bytes."""
    checks, fig = result["checks"], partial(figures_of, result)
    row: dict[str, Any] = {
        "all_ok": bool(checks) and all(record["ok"] for record in checks.values()),
        "passed": sum(record["ok"] for record in checks.values()),
        "checks": len(checks),
        "not_passed": {name: record["status"] for name, record in checks.items() if not record["ok"]},
        "gpu": fig("c0_environment", "gpu"),
        "host_register_read_only_supported": fig("c0_environment", "attributes", "HostRegisterReadOnlySupported"),
        "tandem_staged_path": fig("c1a_tandem_pinned_file", "path"),
        "kernel_raises_after_tandem_load": fig("c1a_tandem_pinned_file", "after_load", "kernel_raises"),
        "kernel_raises_after_read_only_register": fig("c1b_read_only_register", "after_register", "kernel_raises"),
        "host_copy_gb_s": {
            name.split("_", 1)[1]: fig(name, "warm_gb_s")
            for name in checks
            if name.startswith("c1") and fig(name, "warm_gb_s")
        },
        "default_stream_delay_s": fig("c2_stream_hazard", "default_stream_delay_s"),
        "own_stream_delay_s": fig("c2_stream_hazard", "own_stream_delay_s"),
        "learner": {name: checks[name]["status"] for name in checks if name.startswith("c3")},
        "two_ranks_error": fig("c3d_two_ranks_host_tensors", "step_error"),
        "two_ranks_host_tensor_all_reduces": fig("c3d_two_ranks_host_tensors", "all_reduce_host_tensors"),
        "generator_budget_gib": fig("c4_generator_memory", "budget_gib"),
        "generator_memory_gib": {
            shape: model["total_gib"] for shape, model in (fig("c4_generator_memory", "models") or {}).items()
        },
    }
    return {**row, **weights_paths_headline(result)}


def weights_paths_headline(result: dict[str, Any]) -> dict[str, Any]:
    """Seconds and GB/s of each weights path, and its seconds over a device-to-device copy of the same model's
    bytes (C6's first model, the shape C5 runs)."""
    yardstick = next(iter((figures_of(result, "c6_d2d_yardstick", "models") or {}).values()), {})
    row: dict[str, Any] = {"d2d_gb_s": yardstick.get("d2d_gb_s")}
    paths = {
        "staged_update": ("c5a_staged_load", "update_s"),
        "staged_load": ("c5a_staged_load", "load_s"),
        "ipc_update": ("c5b_ipc_load", "update_s"),
        "ipc_load": ("c5b_ipc_load", "load_s"),
        "publish_snapshot": ("c5c_publish_cost", "snapshot_reused_s"),
        "publish_device_buckets": ("c5c_publish_cost", "device_buckets_s"),
    }
    for path, (check, key) in paths.items():
        seconds, nbytes = figures_of(result, check, key), figures_of(result, check, "bytes")
        if seconds:
            row[f"{path}_s"] = seconds
            row[f"{path}_gb_s"] = nbytes / seconds / 1e9
            if yardstick.get("bytes") == nbytes:
                row[f"{path}_over_d2d"] = seconds / yardstick["d2d_s"]
    return row


def report(records: dict[str, dict[str, Any]], device: str, out: Path, budget_s: float, elapsed_s: float) -> Path:
    """The combined result with its headline: on CUDA saved by `benchmarks.common.save` (benchmarks/results/
    gpu_check.json) and copied to `out`; on the CPU (the tests' runs) written to `out` only."""
    result: dict[str, Any] = {"device": device, "budget_s": budget_s, "elapsed_s": elapsed_s, "checks": records}
    result = {"headline": headline(result), **result}
    print(json.dumps(result["headline"], indent=2))
    if device != "cuda":
        path = out / "gpu_check.json"
        path.write_text(json.dumps({"benchmark": "gpu_check", **result}, indent=2))
        return path
    from benchmarks.common import save

    path = save("gpu_check", result)
    shutil.copy(path, out / path.name)
    return path


# ---------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the records (default: a new temp folder)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the checks' CPU forms")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--params", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--record", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def selected(only: str) -> list[Check]:
    names = [name for name in only.split(",") if name]
    unknown = sorted(set(names) - {check.name for check in PLAN})
    if unknown:
        raise SystemExit(f"--only: no check named {unknown}; the checks: {[check.name for check in PLAN]}")
    return [check for check in PLAN if not names or check.name in names]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child is not None:
        code = run_child(args.child, args.device, json.loads(args.params), args.record)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # the record is written: no interpreter teardown (NCCL, CUDA, DeepSpeed) to hang on
    checks = selected(args.only)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(
                "benchmarks.gpu_check needs a GPU (CUDA) and this machine has none: nothing checked, nothing written."
            )
            print("On one it runs, each in its own process:", ", ".join(check.name for check in checks))
            print("(--device cpu runs the checks' CPU forms, as the tests do)")
            return
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_check-"))
    started = time.monotonic()
    records = run_checks(checks, args.device, out, args.budget_s)
    path = report(records, args.device, out, args.budget_s, time.monotonic() - started)
    print(f"records in {out}; result in {path}")
    sys.exit(0 if all(record["ok"] for record in records.values()) else 1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
