"""Length bias of the staleness bound, simulated: the completion lengths generated, trained and dropped as too stale
under buffer.sampling = fifo, uniform and oldest_first, with generators whose groups take longer the longer their
completions are.

    .venv/bin/python -m benchmarks.length_bias                       # 3 modes x 3 seeds x 200 steps, ~15 s here
    .venv/bin/python -m benchmarks.length_bias --steps 40 --seeds 0  # the smoke test's size

No processes and no sockets: a `BufferCore` (the buffer's real message handlers, admission, drop rule and draws)
driven by a discrete-event clock. The model:
- generators: GENERATORS engines of SLOTS slots each (continuous batching). A free slot asks for a lease of one
  prompt with the newest published version (weights load at once), and a group's version is the one it started
  with (its oldest version, which staleness judges, even with in-flight updates). Refused, the slot asks again
  RETRY_S later.
- lengths: each prompt has a typical length, lognormal around MAX_TOKENS / 8 (σ 0.8); each of its GROUP_SIZE
  samples is lognormal around that (σ 0.4), rounded and clipped to [1, MAX_TOKENS] (the clipped ones are the
  truncated completions of the top bucket). Drawn from (seed, prompt id, epoch): every mode generates the same
  lengths for the same prompt.
- a group takes START_S + TOKEN_S x its longest sample: it is pushed when its last sample finishes. A group of
  MAX_TOKENS takes 1.6 learner steps; the generators could start twice the groups the learner trains (the
  training-bound regime of the demo machine, where the spare capacity waits on admission).
- learner: asks for B groups; with a batch, it trains STEP_S and publishes version s + 1 (sync_every = 1), then
  asks again; while too few groups are buffered it asks again after each arrival.
Figures per mode, pooled over seeds and read from the buffer's own `buffer/len_*` metrics (`buffers.lengths`): the
mean length generated and trained, the drop rate (samples dropped as too stale / generated) of every bucket, the
share of samples dropped, the staleness of trained samples and trained samples per simulated second. Writes
results/length_bias.json.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmarks.common import save
from buffers.core import BufferCore
from buffers.lengths import bucket_names, length_metrics
from buffers.state import BufferSettings, BufferState
from common.types import Batch, BatchRequest, LeaseGrant, LeaseRequest, PromptItem, RolloutGroup, VersionReport

MODES = ("fifo", "uniform", "oldest_first")
MAX_TOKENS = 1024
GROUP_SIZE, GROUPS_PER_STEP, ETA = 4, 8, 2
GENERATORS, SLOTS = 2, 8
STEP_S, START_S = 1.0, 0.05
# Seconds per token: "fits", a group of MAX_TOKENS takes 0.05 + 1.54 s = 1.6 steps (< η: it can arrive in time);
# "late", 0.05 + 3.07 s = 3.1 steps (> η: the longest arrive too stale, whatever the draw order).
REGIMES = {"fits": 0.0015, "late": 0.003}
RETRY_S = 0.25  # buffers.staleness.RETRY_FULL_S
PROMPTS = 512


@dataclass
class Prompt:
    """Stands in for common.tasks.PromptRecord (the dispenser reads these three fields)."""

    prompt_id: int
    messages: list[dict[str, str]] = field(default_factory=lambda: [{"role": "user", "content": "?"}])
    metadata: dict[str, Any] = field(default_factory=dict)


def sample_lengths(seed: int, prompt: PromptItem) -> np.ndarray:
    """int64 [GROUP_SIZE]: the completion lengths of this prompt's group (the same in every mode)."""
    rng = np.random.default_rng([seed, prompt.prompt_id, prompt.epoch])
    typical = MAX_TOKENS / 8 * rng.lognormal(0.0, 0.8)
    return np.clip(np.rint(typical * rng.lognormal(0.0, 0.4, GROUP_SIZE)), 1, MAX_TOKENS).astype(np.int64)


def make_group(lease_id: int, generator_id: int, prompt: PromptItem, lengths: np.ndarray, version: int) -> RolloutGroup:
    total = int(lengths.sum())
    return RolloutGroup(
        lease_id=lease_id,
        prompt_id=prompt.prompt_id,
        epoch=prompt.epoch,
        generator_id=generator_id,
        prompt_tokens=np.arange(8, dtype=np.int32),
        offsets=np.concatenate(([0], np.cumsum(lengths))).astype(np.int64),
        completion_tokens=np.zeros(total, np.int32),
        behaviour_logprobs=np.zeros(total, np.float32),
        loss_mask=np.ones(total, np.uint8),
        token_versions=np.full(total, version, np.int32),
        versions=np.full(len(lengths), version, np.int32),
        rewards=np.zeros(len(lengths), np.float32),
        finish_reasons=["length" if n == MAX_TOKENS else "stop" for n in lengths],
    )


class Simulation:
    """One run: the buffer core, the generators' slots and the learner on one event clock (simulated seconds)."""

    slots = SLOTS  # per generator: the groups it generates at once

    def __init__(self, sampling: str, seed: int, steps: int, token_s: float) -> None:
        self.core = BufferCore(BufferState(self.settings(sampling, seed), [Prompt(i) for i in range(PROMPTS)], None))
        self.seed, self.steps, self.token_s = seed, steps, token_s
        self.events: list[tuple[float, int, str, Any]] = []
        self.order = itertools.count()
        self.now, self.step, self.published, self.training = 0.0, 0, 0, False
        self.publications = [(0.0, 0)]  # (simulated second, version) of every weights version published

    def settings(self, sampling: str, seed: int) -> BufferSettings:
        """The buffer's settings (benchmarks.length_bias_episodes widens the length budget for episodes)."""
        return BufferSettings(
            capacity=1 << 20,
            max_reuse=1,
            sampling=sampling,
            lease_timeout_s=1e6,
            heartbeat_timeout_s=1e6,
            epochs=0,
            group_size=GROUP_SIZE,
            max_staleness=ETA,
            groups_per_step=GROUPS_PER_STEP,
            sync_every=1,
            seed=seed,
            vocab_size=8,
            max_model_len=MAX_TOKENS + 8,
            max_tokens=MAX_TOKENS,
        )

    def at(self, when: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(self.events, (when, next(self.order), kind, payload))

    def run(self) -> dict[str, Any]:
        for slot in range(GENERATORS * self.slots):
            self.at(0.0, "lease", slot)
        self.ask_for_batch()
        while self.step < self.steps:
            self.now, _, kind, payload = heapq.heappop(self.events)
            if kind == "lease":
                self.lease(payload)
            elif kind == "push":
                self.handle(self.arrival(payload))
                if not self.training:
                    self.ask_for_batch()
            else:  # "trained": the learner publishes the next version and asks for the next batch
                self.step = self.published = payload + 1
                self.publications.append((self.now, self.published))
                self.handle(VersionReport(self.step, self.published))
                self.training = False
                self.ask_for_batch()
        return {**self.core.metrics(), "sim_s": self.now}

    def handle(self, message: Any) -> Any:
        (_, reply), *_ = self.core.handle(message, reply_to=None, sender="sim", now=self.now)
        return reply

    def arrival(self, payload: Any) -> RolloutGroup:
        """The group a "push" event delivers: its payload, built at lease time (an episode's is built at arrival)."""
        return payload

    def lease(self, slot: int) -> None:
        """A free slot: lease one prompt at the published version and push its group when its longest sample ends."""
        grant = self.handle(LeaseRequest(slot // self.slots, 1, self.published))
        if not isinstance(grant, LeaseGrant):
            self.at(self.now + RETRY_S, "lease", slot)
            return
        prompt = grant.prompts[0]
        lengths = sample_lengths(self.seed, prompt)
        done = self.now + START_S + self.token_s * int(lengths.max())
        self.at(done, "push", make_group(grant.lease_id, slot // self.slots, prompt, lengths, self.published))
        self.at(done, "lease", slot)

    def ask_for_batch(self) -> None:
        reply = self.handle(BatchRequest(self.step, 0, 1, GROUPS_PER_STEP, 0.0))
        if isinstance(reply, Batch):
            self.training = True
            self.at(self.now + STEP_S, "trained", self.step)


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one mode over its seeds: counts summed, then `buffers.lengths.length_metrics` on the sums."""
    counts: Counter[str] = Counter()
    for run in runs:
        counts.update({k.removeprefix("buffer/"): v for k, v in run["metrics"].items() if k.startswith("buffer/len_")})
    edges = runs[0]["edges"]
    values = length_metrics(counts, edges)
    names = bucket_names(edges)
    generated = [counts[f"len_generated/{name}"] for name in names]
    dropped = [counts[f"len_dropped_stale/{name}"] for name in names]
    samples = sum(run["metrics"]["buffer/trained"] for run in runs)
    return {
        "len_generated_mean": values["buffer/len_generated_mean"],
        "len_trained_mean": values["buffer/len_trained_mean"],
        "trained_over_generated_mean": values["buffer/len_trained_mean"] / values["buffer/len_generated_mean"],
        "drop_rate_longest": values["buffer/len_drop_rate_longest"],
        "drop_rate_shortest": values["buffer/len_drop_rate_shortest"],
        "dropped_share": sum(dropped) / sum(generated),
        "drop_rate_by_bucket": {n: d / g if g else None for n, g, d in zip(names, generated, dropped)},
        "generated_by_bucket": dict(zip(names, generated)),
        "trained_by_bucket": {name: counts[f"len_trained/{name}"] for name in names},
        "staleness_mean": float(np.mean([run["metrics"]["buffer/staleness_mean"] for run in runs])),
        "samples_per_s": samples / sum(run["metrics"]["sim_s"] for run in runs),
    }


def run_mode(mode: str, seeds: list[int], steps: int, token_s: float) -> dict[str, Any]:
    runs = []
    for seed in seeds:
        sim = Simulation(mode, seed, steps, token_s)
        runs.append({"seed": seed, "metrics": sim.run(), "edges": sim.core.state.lengths.edges})
    figures = pooled(runs)
    print(
        f"{mode:>12}: mean length generated {figures['len_generated_mean']:.1f} trained "
        f"{figures['len_trained_mean']:.1f} ({figures['trained_over_generated_mean']:.3f}x); dropped "
        f"{figures['dropped_share']:.1%} of samples, longest bucket {figures['drop_rate_longest']:.1%}, shortest "
        f"{figures['drop_rate_shortest']:.1%}; staleness {figures['staleness_mean']:.2f}, "
        f"{figures['samples_per_s']:.1f} samples/s",
        flush=True,
    )
    return {**figures, "runs": [{"seed": run["seed"], "metrics": run["metrics"]} for run in runs]}


HEADLINE_KEYS = (
    "len_generated_mean",
    "len_trained_mean",
    "trained_over_generated_mean",
    "drop_rate_longest",
    "drop_rate_shortest",
    "dropped_share",
    "staleness_mean",
    "samples_per_s",
)


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """Per regime and mode, the pooled figures of HEADLINE_KEYS (from the saved `regimes`)."""
    return {
        regime: {mode: {key: figures[key] for key in HEADLINE_KEYS} for mode, figures in values["modes"].items()}
        for regime, values in result["regimes"].items()
    }


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """`--steps` and `--seeds` of a length-bias simulation; quiets the buffer's per-step drop warnings."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=120, help="learner steps per run (default 120)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args(argv)
    if args.steps < 10:
        parser.error("--steps must be >= 10 (the first steps only fill the pipeline)")
    logging.getLogger("tandem.buffer").setLevel(logging.ERROR)  # a warning per step with drops: the figures say it
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__.split("\n")[0])
    started = time.perf_counter()
    regimes: dict[str, dict[str, Any]] = {}
    for regime, token_s in REGIMES.items():
        longest = (START_S + token_s * MAX_TOKENS) / STEP_S
        print(f"{regime}: a group of {MAX_TOKENS} tokens takes {longest:.1f} learner steps (η = {ETA})")
        regimes[regime] = {"token_s": token_s, "longest_group_steps": longest}
        regimes[regime]["modes"] = {mode: run_mode(mode, args.seeds, args.steps, token_s) for mode in MODES}
    elapsed = time.perf_counter() - started
    print(f"{len(REGIMES) * len(MODES) * len(args.seeds)} runs of {args.steps} steps in {elapsed:.1f} s")
    model = {
        "max_tokens": MAX_TOKENS,
        "group_size": GROUP_SIZE,
        "groups_per_step": GROUPS_PER_STEP,
        "max_staleness": ETA,
        "generators": GENERATORS,
        "slots": SLOTS,
        "step_s": STEP_S,
        "start_s": START_S,
        "prompts": PROMPTS,
    }
    result = {"steps": args.steps, "seeds": args.seeds, "model": model, "regimes": regimes}
    save("length_bias", {"headline": headline(result), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
