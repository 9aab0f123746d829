"""Weight sync latency: from "the publisher has the new weights" to "the generator samples with them", beside a
memcpy of the same bytes.

    .venv/bin/python -m benchmarks.weight_sync [--updates 3]

A real `tandem generator` (vLLM, SmolLM2-135M-Instruct if prepared, else the tiny model) runs against a fake buffer
that refuses leases ("full": admission control) until the generator reports the version just published, and a fake
publisher that long-polls (holds a request until a newer version exists). Per update v:
  published   the publisher holds v (packed into buckets: the learner's work, not timed)
  sent        the publisher answers the generator's held request with v
  leased      the buffer sees a lease request at v: the weights are loaded into vLLM
  sampled     the buffer receives the 1-token group sampled with v (every token stamped v)
Latency = sampled - published (after one warm-up sample at v0). Baselines for the same bytes in this process:
a fresh copy (allocate + copy: what receiving them costs at least) and a copy into warm, preallocated memory
(the hardware floor).
The generator's own log gives the rest of the split (`VllmEngine.load_weights` logs its stages with wall-clock
stamps), so each update's latency is cut into `PROFILE_STAGES` (seconds each, their median in `profile`):
  publisher_send     published -> the publisher answers the held request
  receive_and_check  -> the generator holds the whole checked update (socket receive, check_frames)
  notice             -> its loop starts the load (the fetch thread finished while the loop slept or stepped)
  stage              the copy into the shared-memory staging file (none when the transport staged it)
  worker_map         the worker maps the file (page tables filled at once)
  worker_copy        the model's load_weights copies every tensor into vLLM's parameters
  worker_repack      process_weights_after_loading: the CPU backend's oneDNN repack of the linear layers and the
                     output layer (the only processing these layers need)
  rpc_and_reset      collective_rpc round trip beyond the worker's own time, version label, prefix-cache reset
  lease              -> the buffer sees the lease at the new version (the loop's next pass, the round trip)
  sample             -> the 1-token group (2 samples of a ~50-token prompt: a prefill) reaches the buffer
The transport is "star" (the fake publisher's); with "relay" the generator writes the host copy while receiving
and `stage` is 0. Target: latency <= 3x the fresh memcpy. Writes results/weight_sync.{json,png}.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import best_seconds, save
from benchmarks.generator_rig import benchmark_model, task_items
from common.types import LeaseRefused
from launch.testing import FakeBuffer, FakePublisher, RoleUnderTest, run_config

LOAD_LINE = re.compile(r"weights v(\d+) -> v(\d+) \(([\d.]+) MB\) loaded in ([\d.]+)s \(([\d.]+)s since received\)")
SPLIT_LINE = re.compile(r"weights v(\d+) load split \(([a-z_]+)[^)]*\): (.*)")
PROFILE_STAGES = (
    "publisher_send",
    "receive_and_check",
    "notice",
    "stage",
    "worker_map",
    "worker_copy",
    "worker_repack",
    "rpc_and_reset",
    "lease",
    "sample",
)


def checkpoint_arrays(model_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor of the model's safetensors, bf16 as raw 16-bit words (what a learner would publish)."""
    import torch
    from safetensors.torch import load_file

    arrays, dtypes = {}, {}
    for name, tensor in load_file(str(model_dir / "model.safetensors")).items():
        if tensor.dtype == torch.bfloat16:
            arrays[name], dtypes[name] = tensor.contiguous().view(torch.uint16).numpy(), "bfloat16"
        else:
            arrays[name] = tensor.contiguous().numpy()
    return arrays, dtypes


def memcpy_baselines(nbytes: int) -> dict[str, float]:
    source = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    return {
        "fresh_copy_s": best_seconds(lambda: source.copy(), repeat=5, warmup=1),
        "warm_copy_s": best_seconds(lambda: np.copyto(target, source), repeat=5, warmup=2),
    }


def _wait(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s}s")
        time.sleep(0.002)


def measure_updates(model_dir: Path, updates: int) -> tuple[list[dict[str, float]], int, str]:
    arrays, dtypes = checkpoint_arrays(model_dir)
    nbytes = sum(a.nbytes for a in arrays.values())
    tmp = Path(tempfile.mkdtemp(prefix="bench-sync-"))
    config = run_config(
        tmp / "runs",
        "gen",
        model={"path": str(model_dir), "max_model_len": 1024},
        algo={"group_size": 2},
        generator={"max_tokens": 1, "prompts_in_flight": 1, "reconnect_max_s": 0.5},
        weights={"transport": "star"},  # what the fake publisher speaks
    )
    buffer = FakeBuffer(config, [], lease_size=1, when_empty="full")
    buffer.retry_after_s = 0.005
    target = {"version": 0}
    buffer.refusal = lambda r: None if r.policy_version >= target["version"] else LeaseRefused("full", 0, 0.005)
    publisher = FakePublisher(config.learner.weights_port, bucket_bytes=64 << 20, hold_s=20.0)
    buffer.start()
    publisher.start()
    generator = RoleUnderTest(config, "generator")
    rows = []
    try:
        with generator:
            buffer.add_prompts(task_items(1))  # warm-up: the first prefill of a process is slow
            _wait(lambda: buffer.groups, 600, "the warm-up group (engine start)")
            for version in range(1, updates + 1):
                prompt = task_items(1, first_id=version)
                target["version"] = version
                buffer.add_prompts(prompt)
                publisher.publish(version, arrays, dtypes)  # the same bytes each time: what is timed is the path
                arrived = lambda v=version: any(g.prompt_id == v for g in buffer.groups.values())
                _wait(arrived, 120, f"a group at v{version}")
                group = next(g for g in buffer.groups.values() if g.prompt_id == version)
                assert (group.token_versions == version).all(), group.token_versions
                published = publisher.published_at[version]
                requests = zip(buffer.lease_times, buffer.lease_requests)
                leased = next(t for t, r in requests if r.policy_version >= version)
                rows.append(
                    {
                        "version": version,
                        "published": published,
                        "sent_s": publisher.sent_at[version] - published,
                        "leased_s": leased - published,
                        "sampled_s": buffer.group_times[group.group_id] - published,
                    }
                )
                print(f"v{version}: {rows[-1]}", flush=True)
            generator.stop()
        log = generator.output()
    finally:
        buffer.stop()
        publisher.stop()
    for match in LOAD_LINE.finditer(log):
        version = int(match.group(2))
        if 1 <= version <= len(rows):
            rows[version - 1]["load_s"] = float(match.group(4))
            rows[version - 1]["received_to_loaded_s"] = float(match.group(5))
    for match in SPLIT_LINE.finditer(log):
        version = int(match.group(1))
        if 1 <= version <= len(rows):
            split = {key: float(value) for key, value in (item.split("=") for item in match.group(3).split())}
            rows[version - 1]["profile"] = stage_split(rows[version - 1], split)
            rows[version - 1]["load_path"] = match.group(2)
    return rows, nbytes, log


def stage_split(row: dict[str, Any], split: dict[str, float]) -> dict[str, float]:
    """One update's latency cut into `PROFILE_STAGES` (see the module docstring): the benchmark's stamps (published,
    sent, leased, sampled: time.time() here) and the engine's (received, started: time.time() in the generator,
    the same clock) around the engine's own stage durations. The stages add up to `sampled_s`."""
    published = row["published"]
    started = split["started"] - published
    loaded = started + sum(value for key, value in split.items() if key.endswith("_s"))
    stages = {
        "publisher_send": row["sent_s"],
        "receive_and_check": split["received"] - published - row["sent_s"],
        "notice": started - (split["received"] - published),
        "stage": split["stage_s"],
        "worker_map": split["worker_map_s"],
        "worker_copy": split["worker_load_s"],
        "worker_repack": split["worker_process_s"],
        "rpc_and_reset": sum(split[k] for k in ("pause_s", "rpc_overhead_s", "version_and_cache_reset_s", "resume_s")),
        "lease": row["leased_s"] - loaded,
        "sample": row["sampled_s"] - row["leased_s"],
    }
    return stages


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures issues quote: publish -> first sample at the new version, in seconds and over a fresh memcpy."""
    keys = ("bytes", "median_latency_s", "latency_over_fresh_memcpy", "target_over_fresh_memcpy")
    return {**{key: result[key] for key in keys}, "ratio_to_memcpy": result["latency_over_fresh_memcpy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=3)
    args = parser.parse_args()
    model_dir, model_name = benchmark_model()
    rows, nbytes, _ = measure_updates(model_dir, args.updates)
    baselines = memcpy_baselines(nbytes)
    latency = float(np.median([r["sampled_s"] for r in rows]))
    ratio = latency / baselines["fresh_copy_s"]
    print(
        f"model: {model_name}, {nbytes / 1e6:.0f} MB; memcpy fresh {baselines['fresh_copy_s']:.3f}s, "
        f"warm {baselines['warm_copy_s']:.3f}s"
    )
    print(
        f"publish -> sampled with the new version: median {latency:.3f}s = {ratio:.2f}x a fresh memcpy "
        f"(target <= 3x), {latency / baselines['warm_copy_s']:.1f}x a warm one"
    )
    profiled = [r["profile"] for r in rows if "profile" in r]
    profile = {stage: float(np.median([p[stage] for p in profiled])) for stage in PROFILE_STAGES} if profiled else {}
    print(f"where it goes (median s per stage, load path {rows[-1].get('load_path', '?')}):")
    for stage, seconds in profile.items():
        print(f"  {stage:<18} {seconds:.4f}")

    def plot(axes: Any) -> None:
        x = np.arange(len(rows))
        bottom = np.zeros(len(rows))
        for stage in PROFILE_STAGES:  # stacked: each update's latency, stage by stage
            heights = np.array([r.get("profile", {}).get(stage, 0.0) for r in rows])
            axes.bar(x, heights, bottom=bottom, width=0.6, label=stage)
            bottom += heights
        axes.axhline(baselines["fresh_copy_s"], color="k", linestyle="--", label="fresh memcpy")
        axes.axhline(3 * baselines["fresh_copy_s"], color="r", linestyle=":", label="3x fresh memcpy")
        axes.set_xticks(x, [f"v{r['version']}" for r in rows])
        axes.set_ylabel("seconds after publish")
        axes.set_title(f"{model_name}: {nbytes / 1e6:.0f} MB, median {latency:.2f}s = {ratio:.1f}x memcpy")
        axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))

    result = {
        "model": model_name,
        "bytes": nbytes,
        "updates": rows,
        "baselines": baselines,
        "median_latency_s": latency,
        "latency_over_fresh_memcpy": ratio,
        "latency_over_warm_memcpy": latency / baselines["warm_copy_s"],
        "target_over_fresh_memcpy": 3.0,
        "profile": profile,
    }
    save("weight_sync", {"headline": headline(result), **result}, plot)


if __name__ == "__main__":
    main()
