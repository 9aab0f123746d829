"""The figures of `benchmarks.time_to_reward`: per run, per sync/async pair, and the headline, from metrics records.

Pure functions of the learner's `metrics.jsonl` records (lists of dicts); `benchmarks.time_to_reward` runs the grid
or finds the kept runs, and prints, saves and plots what these return.

Figures per run, all from the learner's `metrics.jsonl` (every run has one, the kept runs only that):
- time to target: `time` (seconds on the learner's metrics clock, the clock of the issue's figures) of the first
  step whose trailing mean reaches `--target`. The trailing mean at step k is the plain mean of the reward of the
  TRAILING = 3 records ending at k (steps k-2, k-1, k); it exists from the third record on. Never reached: null,
  with `reached: false` ("not reached" in the printout), and the run's last time beside it.
  The reward is `reward/mean`, the mean reward of the batch trained at that step. That is unbiased only when no
  group is filtered: with `no_signal` the dropped groups are the all-equal ones (all right, all wrong), so the
  trained batch's mean leaves out exactly the all-right groups a good policy makes (with 0/1 rewards and n = 8 a
  kept group scores at most 7/8 < 0.9). A filtered run's curve is the reward of every group that arrived for the
  step, trained or filtered (`generated_rewards`), from two cumulative counters of the buffer in the learner's
  record (as `buffer/dropped_stale` is): FILTERED_SAMPLES_KEY and FILTERED_REWARD_SUM_KEY. Between the records of
  steps k-1 and k (from 0 before the first) they grow by dN filtered samples of reward sum dS, so
      generated(k) = (reward/mean(k) * perf/samples(k) + dS) / (perf/samples(k) + dN).
  A filtered run without those counters gets a null time, with that reason.
- samples/s: trained samples per second from step FIRST_STEP's record to the last (`benchmarks.runs.trained_rate`;
  step 1 is left out because an asynchronous run's first batch also waits for the generator's start-up).
- t_gen = mean `perf/wait_s` and t_train = mean `perf/train_s` + `perf/publish_s` after FIRST_STEP. At η = 0 the
  learner publishes, then waits while the generator loads the weights and generates the whole next batch, then
  trains: its wait is the generation share of a step and the rest its own, and the two never overlap (`perf/step_s`
  = wait + train + publish). These are the learner's figures because they exist in every run, kept ones included,
  and they are the serial split that overlap removes; the generator's own stream does not say which of its time the
  learner waited for. Step 1 is left out here too: at η = 0 its batch was generated while the learner loaded (a
  0.01 s wait in the kept run), so counting it understates t_gen (the issue's 5.6 s is the mean over all 30 steps;
  this is 5.8 s). With the filter on, t_gen includes generating the groups that were filtered.
- overlap bound, from the synchronous run of a pair: (t_gen + t_train) / max(t_gen, t_train), the most that
  generating the next batch while training on this one can give.
- achieved = async samples/s / sync samples/s (same seed and filter), and `fraction_of_bound` = achieved / bound.

Headline: `async_fraction_of_bound`, the median over seeds of the no-filter pairs' fraction (target >= 0.9), and
`time_to_reward_ratio`, the median over seeds of time to target at `eta2-ds` over `eta0` (target <= 0.8). A seed
where only the synchronous run reached the target orders as +inf (slower than any figure), one where only the
asynchronous run did as 0; a median that falls on such a value, or with no pair at all, is null with its reason.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from benchmarks.runs import mean_of, trained_rate

TRAILING = 3  # records in the trailing mean of the reward
FIRST_STEP = 1  # rates and time splits are measured after this step's record
TARGET_FRACTION_OF_BOUND = 0.9
TARGET_TIME_RATIO = 0.8
REWARD_KEY = "reward/mean"
GENERATED_REWARD_KEY = "reward/generated_mean"  # computed here for filtered runs (`generated_rewards`)
FILTERED_SAMPLES_KEY = "buffer/dropped_no_signal"  # samples filtered so far (cumulative)
FILTERED_REWARD_SUM_KEY = "buffer/no_signal_reward_sum"  # their rewards' sum so far (cumulative)
ASYNC_NOT_REACHED = "the asynchronous run did not reach the target in most seeds"


@dataclass(frozen=True)
class RunKey:
    """Which cell of the grid a run is: its η, whether it filtered no-signal groups, its seed."""

    eta: int
    dynamic: bool
    seed: int

    @property
    def cell(self) -> str:
        return f"eta{self.eta}{'-ds' if self.dynamic else ''}"


def trailing_means(values: list[float], window: int = TRAILING) -> list[float | None]:
    """Position i: the mean of values[i - window + 1 .. i]; None for the first window - 1 positions."""
    return [None if i + 1 < window else math.fsum(values[i + 1 - window : i + 1]) / window for i in range(len(values))]


def time_to_target(records: list[dict[str, Any]], target: float, key: str = REWARD_KEY) -> dict[str, Any]:
    """The first record whose trailing mean of `key` reaches `target` (records that lack `key` are skipped):
    its step and time, or `reached: false` with nulls. Also the curve, for the plot."""
    rows = [r for r in records if isinstance(r.get(key), (int, float))]
    means = trailing_means([float(r[key]) for r in rows])
    hit = next((i for i, mean in enumerate(means) if mean is not None and mean >= target), None)
    return {
        "reward_key": key,
        "reached": hit is not None,
        "step": None if hit is None else int(rows[hit]["step"]),
        "time_s": None if hit is None else float(rows[hit]["time"]),
        "trailing_mean_at_target": None if hit is None else means[hit],
        "last_time_s": float(rows[-1]["time"]) if rows else None,
        "curve": [{"step": r["step"], "time": r["time"], "reward": r[key], "trailing": m} for r, m in zip(rows, means)],
    }


def step_split(records: list[dict[str, Any]]) -> dict[str, float]:
    """t_gen and t_train of a run (see the module docstring), means over the records after FIRST_STEP."""
    t_gen = mean_of(records, "perf/wait_s", FIRST_STEP)
    t_train = mean_of(records, "perf/train_s", FIRST_STEP) + mean_of(records, "perf/publish_s", FIRST_STEP)
    return {"t_gen_s": t_gen, "t_train_s": t_train}


def overlap_bound(t_gen: float, t_train: float) -> float:
    """(t_gen + t_train) / max(t_gen, t_train): a step at η = 0 costs the sum, overlapped at best the larger."""
    if t_gen < 0 or t_train < 0 or max(t_gen, t_train) <= 0:
        raise ValueError(f"the bound needs non-negative times, not both zero: t_gen {t_gen}, t_train {t_train}")
    return (t_gen + t_train) / max(t_gen, t_train)


def generated_rewards(records: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The records with GENERATED_REWARD_KEY added: the mean reward of the step's trained samples and of the samples
    filtered since the previous record (module docstring); None when a record lacks the filter's counters."""
    counters = (FILTERED_SAMPLES_KEY, FILTERED_REWARD_SUM_KEY, REWARD_KEY, "perf/samples")
    if not records or not all(isinstance(r.get(k), (int, float)) for r in records for k in counters):
        return None
    out, samples_before, sum_before = [], 0.0, 0.0
    for record in sorted(records, key=lambda r: r["step"]):
        filtered = record[FILTERED_SAMPLES_KEY] - samples_before  # dN
        filtered_sum = record[FILTERED_REWARD_SUM_KEY] - sum_before  # dS
        trained = record["perf/samples"]
        mean = (record[REWARD_KEY] * trained + filtered_sum) / (trained + filtered)
        out.append({**record, GENERATED_REWARD_KEY: mean})
        samples_before, sum_before = record[FILTERED_SAMPLES_KEY], record[FILTERED_REWARD_SUM_KEY]
    return out


def run_figures(key: RunKey, label: str, records: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Every per-run figure of the module docstring."""
    generated = generated_rewards(records) if key.dynamic else None
    if key.dynamic and generated is None:
        reached = time_to_target(records, target)
        reached.update(reached=False, step=None, time_s=None, trailing_mean_at_target=None)
        reached["why_null"] = (
            f"{REWARD_KEY} of a run with buffer.filter = no_signal leaves out the filtered groups (biased low), and "
            f"its records lack {FILTERED_SAMPLES_KEY} and {FILTERED_REWARD_SUM_KEY} to count them back in"
        )
    else:
        reached = time_to_target(generated or records, target, GENERATED_REWARD_KEY if key.dynamic else REWARD_KEY)
    return {
        "label": label,
        "cell": key.cell,
        "eta": key.eta,
        "dynamic_sampling": key.dynamic,
        "seed": key.seed,
        "steps": len(records),
        "samples_per_s": trained_rate(records, FIRST_STEP)["samples_per_s"],
        **step_split(records),
        "time_to_target": reached,
    }


def pair_figures(sync: dict[str, Any], asynchronous: dict[str, Any]) -> dict[str, Any]:
    """The bound from the synchronous run, the achieved async/sync throughput ratio, and its share of the bound."""
    bound = overlap_bound(sync["t_gen_s"], sync["t_train_s"])
    achieved = asynchronous["samples_per_s"] / sync["samples_per_s"]
    return {
        "seed": sync["seed"],
        "dynamic_sampling": sync["dynamic_sampling"],
        "overlap_bound": bound,
        "achieved_ratio": achieved,
        "fraction_of_bound": achieved / bound,
    }


def time_ratio(asynchronous: dict[str, Any], sync: dict[str, Any]) -> float | None:
    """Async time to target over sync's; +inf when only sync reached it, 0 when only async did, None if neither."""
    a, s = asynchronous["time_to_target"]["time_s"], sync["time_to_target"]["time_s"]
    if a is None and s is None:
        return None
    return math.inf if a is None else 0.0 if s is None else a / s


def median_of_seeds(values: list[float]) -> tuple[float | None, str | None]:
    """(median, None), or (None, why) when there is no value or the median is not a finite, positive figure
    (it falls on a seed that reached the target in one run only)."""
    if not values:
        return None, "no pair of runs to compare"
    ordered, middle = sorted(values), len(values) // 2
    picks = ordered[middle : middle + 1] if len(values) % 2 else ordered[middle - 1 : middle + 1]
    if any(v == math.inf for v in picks):
        return None, ASYNC_NOT_REACHED
    if any(v == 0.0 for v in picks):
        return None, "the synchronous run did not reach the target in most seeds: raise --steps"
    return statistics.fmean(picks), None


def pairs(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per seed: each sync/async pair of one filter setting (`throughput`), and the time to target of eta2-ds
    over eta0 (`time_to_reward`; `ordered_as` is what the median orders it as, see `time_ratio`)."""
    by = {(run["cell"], run["seed"]): run for run in runs}
    throughput, time_to_reward = [], []
    for seed in sorted({run["seed"] for run in runs}):
        for sync_cell, async_cell in (("eta0", "eta2"), ("eta0-ds", "eta2-ds")):
            if (sync_cell, seed) in by and (async_cell, seed) in by:
                throughput.append(pair_figures(by[(sync_cell, seed)], by[(async_cell, seed)]))
        if ("eta0", seed) in by and ("eta2-ds", seed) in by:
            ordered = time_ratio(by[("eta2-ds", seed)], by[("eta0", seed)])
            finite = ordered is not None and 0.0 < ordered < math.inf
            time_to_reward.append({"seed": seed, "ratio": ordered if finite else None, "ordered_as": ordered})
    return {"throughput": throughput, "time_to_reward": time_to_reward}


def headline(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The two headline figures (median over seeds), their targets and whether each is met."""
    found = pairs(runs)
    fractions = [p["fraction_of_bound"] for p in found["throughput"] if not p["dynamic_sampling"]]
    fraction, fraction_why = median_of_seeds(fractions)
    ordered = [p["ordered_as"] for p in found["time_to_reward"] if p["ordered_as"] is not None]
    ratio, ratio_why = median_of_seeds(ordered)
    if not any(run["dynamic_sampling"] for run in runs):
        ratio_why = "pending: no run with buffer.filter = no_signal (the eta2-ds cell of the grid has not run)"
    ratio_met = ratio <= TARGET_TIME_RATIO if ratio is not None else False if ratio_why == ASYNC_NOT_REACHED else None
    return {
        "target_reward": target,
        "async_fraction_of_bound": fraction,
        "async_fraction_of_bound_why_null": fraction_why,
        "target_async_fraction_of_bound": TARGET_FRACTION_OF_BOUND,
        "async_fraction_of_bound_met": None if fraction is None else fraction >= TARGET_FRACTION_OF_BOUND,
        "time_to_reward_ratio": ratio,
        "time_to_reward_ratio_why_null": ratio_why,
        "target_time_to_reward_ratio": TARGET_TIME_RATIO,
        "time_to_reward_ratio_met": ratio_met,
        "time_to_target_s": {f"{run['cell']}/seed{run['seed']}": run["time_to_target"]["time_s"] for run in runs},
        "seeds": sorted({run["seed"] for run in runs}),
        "pairs_compared": {"throughput": len(fractions), "time_to_reward": len(ordered)},
    }
