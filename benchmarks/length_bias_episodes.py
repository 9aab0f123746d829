"""Length bias of the staleness bound in multi-turn runs, simulated: the episodes generated, trained and dropped as
too stale, by episode length (model tokens) and by turns, under buffer.sampling = fifo, uniform and oldest_first,
with generators whose episodes take longer the more turns they run.

    .venv/bin/python -m benchmarks.length_bias_episodes                       # 3 regimes x 3 modes x 3 seeds, ~40 s
    .venv/bin/python -m benchmarks.length_bias_episodes --steps 20 --seeds 0  # the smoke test's size

The clock, the generators' slots, the learner and the buffer (a real `BufferCore`: admission, drop rule, draws,
`buffer/len_*` and `buffer/turns_*` metrics) are `benchmarks.length_bias`'s; what changes is what a slot
generates. A leased prompt is one group of GROUP_SIZE episodes, run side by side (each its own engine sequence),
pushed when the last ends; an episode of the group:
- turns: the prompt has a typical number of turns, uniform on 1 .. MAX_TURNS (how many steps its task needs);
  each episode takes that ±1 (uniform), clipped to [1, MAX_TURNS]. Drawn from (seed, prompt id, epoch): every mode
  generates the same episodes for the same prompt.
- a turn samples lognormal(TURN_TOKENS, σ 0.5) tokens clipped to [1, TURN_MAX_TOKENS] (generator.max_tokens) and
  to the room left under MAX_TOTAL_TOKENS (env.max_total_tokens: model and environment tokens, the episode driver's
  rule: `actors.environments.episodes`); then the environment takes ENV_S and, if the episode goes on, answers ENV_TOKENS tokens.
- a turn takes START_S + token_s x its tokens, then ENV_S. Every model token carries the version published when
  its turn began (the generator loads weights between turns), so the episode's version (its oldest token's, which
  staleness judges) is that of its first turn: a long episode arrives as stale as it is long.
- the group is the real layout (`actors.environments.trajectory.Trajectory` and `build_episode_group`: environment tokens masked
  out), so the buffer counts its turns from the loss mask as it does in a run.
Regimes (token_s, env_s): "fits", the longest group (MAX_TURNS turns of TURN_MAX_TOKENS) takes 1.46 learner steps,
under η = 2; "near", 1.98, just under η; "late", the typical 8-turn episode already takes 2.75 steps, more than η,
and no draw order can train it within the bound. Figures per mode, pooled over seeds: the drop rate by length
and by turn bucket, the shares dropped, the staleness of trained samples. Writes results/length_bias_episodes.json.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections import Counter
from typing import Any

import numpy as np

from actors.engine.api import FinishedSample
from actors.environments.trajectory import EpisodeResult, Trajectory, build_episode_group
from benchmarks import length_bias
from benchmarks.common import save
from buffers.lengths import bucket_names, length_edges, length_metrics
from buffers.state import BufferSettings
from common.types import LeaseGrant, LeaseRequest, PromptItem, RolloutGroup

MODES = length_bias.MODES
GROUP_SIZE, ETA = length_bias.GROUP_SIZE, length_bias.ETA  # η = 2: examples/demo.toml's algo.max_staleness
MAX_TURNS, MAX_TOTAL_TOKENS, TURN_MAX_TOKENS = 8, 1024, 128  # env.max_turns, env.max_total_tokens, generator.max_tokens
TURN_TOKENS, ENV_TOKENS, PROMPT_TOKENS = 48, 16, 8
START_S = length_bias.START_S
# Groups a generator runs at once (GROUP_SIZE episodes each: 64 engine sequences). Twice length_bias's: an episode's
# sequence waits on its environment between turns, so a multi-turn generator runs more episodes than it has busy
# sequences; with these the generators could start about twice the groups the learner trains in both regimes (the
# training-bound regime, where the draw order decides what is dropped).
SLOTS = 16
# (token_s, env_s). "fits": 8 turns of 128 tokens take 8 x (0.05 + 0.0008 x 128 + 0.03) = 1.46 steps (< η); "near":
# 8 x (0.05 + 0.001 x 128 + 0.07) = 1.98 steps, just under η; "late": 8 typical turns (48 tokens) take
# 8 x (0.05 + 0.003 x 48 + 0.15) = 2.75 steps (> η: dropped whatever the order).
REGIMES = {"fits": (0.0008, 0.03), "near": (0.001, 0.07), "late": (0.003, 0.15)}


def episode_turns(seed: int, prompt: PromptItem) -> list[list[int]]:
    """The model tokens of each turn of each of the group's GROUP_SIZE episodes (the same in every mode)."""
    rng = np.random.default_rng([seed, prompt.prompt_id, prompt.epoch])
    typical = int(rng.integers(1, MAX_TURNS + 1))
    episodes = []
    for _ in range(GROUP_SIZE):
        turns = int(np.clip(typical + rng.integers(-1, 2), 1, MAX_TURNS))
        sizes = np.clip(np.rint(TURN_TOKENS * rng.lognormal(0.0, 0.5, turns)), 1, TURN_MAX_TOKENS).astype(int)
        episodes.append(sizes.tolist())
    return episodes


class EpisodeSimulation(length_bias.Simulation):
    """`length_bias.Simulation` whose slots run groups of multi-turn episodes (module docstring)."""

    slots = SLOTS

    def __init__(self, sampling: str, seed: int, steps: int, regime: tuple[float, float]) -> None:
        super().__init__(sampling, seed, steps, token_s=regime[0])
        self.env_s = regime[1]

    def settings(self, sampling: str, seed: int) -> BufferSettings:
        base = super().settings(sampling, seed)
        return dataclasses.replace(
            base, max_tokens=MAX_TOTAL_TOKENS, max_turns=MAX_TURNS, max_model_len=PROMPT_TOKENS + MAX_TOTAL_TOKENS
        )

    def lease(self, slot: int) -> None:
        """A free slot: lease one prompt at the published version; its group arrives when its last episode ends."""
        grant = self.handle(LeaseRequest(slot // self.slots, 1, self.published))
        if not isinstance(grant, LeaseGrant):
            self.at(self.now + length_bias.RETRY_S, "lease", slot)
            return
        prompt = grant.prompts[0]
        episodes = [self.timed_turns(turns) for turns in episode_turns(self.seed, prompt)]
        done = max(ends[-1] for _, ends in episodes)
        self.at(done, "push", (grant.lease_id, slot // self.slots, prompt, self.now, episodes))
        self.at(done, "lease", slot)

    def timed_turns(self, turns: list[int]) -> tuple[list[int], list[float]]:
        """(tokens of each turn that fits MAX_TOTAL_TOKENS, the second each turn's environment step ends)."""
        kept, ends, used, clock = [], [], 0, self.now
        for tokens in turns:
            tokens = min(tokens, MAX_TOTAL_TOKENS - used)
            if tokens < 1:
                break
            clock += START_S + self.token_s * tokens + self.env_s
            kept.append(tokens)
            ends.append(clock)
            used += tokens + ENV_TOKENS
        return kept, ends

    def arrival(self, payload: Any) -> RolloutGroup:
        """The group of finished episodes, built as the generator builds it, each turn's tokens stamped with the
        version published when the turn began (its start: the previous turn's end, or the lease)."""
        lease_id, generator_id, prompt, leased_at, episodes = payload
        times = [when for when, _ in self.publications]
        results = []
        for turns, ends in episodes:
            trajectory = Trajectory(list(range(PROMPT_TOKENS)))
            began = [leased_at, *ends[:-1]]
            versions = [self.publications[bisect.bisect_right(times, when) - 1][1] for when in began]
            for i, (tokens, version) in enumerate(zip(turns, versions)):
                sample = FinishedSample(
                    f"{lease_id}:{i}",
                    np.zeros(tokens, np.int32),
                    np.zeros(tokens, np.float32),
                    np.full(tokens, version, np.int32),
                    "stop",
                    version,
                )
                trajectory.add_model_turn(sample)
                if i + 1 < len(turns):
                    trajectory.add_environment([1] * ENV_TOKENS)
            reason = "max_turns" if len(turns) == MAX_TURNS else "done"
            results.append(EpisodeResult(trajectory, versions[0], reason, len(turns), {"terminal": 0.0}))
        return build_episode_group(lease_id, prompt, results, generator_id, started_at=leased_at)


def by_bucket(counts: Counter[str], prefix: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """Per bucket: generated, trained and dropped samples and the drop rate (None where nothing was generated)."""
    rows = {}
    for name in names:
        generated, dropped = counts[f"{prefix}_generated/{name}"], counts[f"{prefix}_dropped_stale/{name}"]
        rows[name] = {
            "generated": generated,
            "trained": counts[f"{prefix}_trained/{name}"],
            "dropped_stale": dropped,
            "drop_rate": dropped / generated if generated else None,
        }
    return rows


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one mode over its seeds, from the summed `buffer/len_*` and `buffer/turns_*` counts."""
    counts: Counter[str] = Counter()
    for run in runs:
        counts.update(
            {k.removeprefix("buffer/"): v for k, v in run.items() if k.startswith(("buffer/len_", "buffer/turns_"))}
        )
    edges, turn_edges = length_edges(MAX_TOTAL_TOKENS), length_edges(MAX_TURNS)
    values = length_metrics(counts, edges, turn_edges)
    generated = sum(counts[f"len_generated/{name}"] for name in bucket_names(edges))
    dropped = sum(counts[f"len_dropped_stale/{name}"] for name in bucket_names(edges))
    return {
        "dropped_share": dropped / generated,
        "turns_generated_mean": values["buffer/turns_generated_mean"],
        "turns_trained_mean": values["buffer/turns_trained_mean"],
        "len_generated_mean": values["buffer/len_generated_mean"],
        "len_trained_mean": values["buffer/len_trained_mean"],
        "turns_drop_rate_longest": values["buffer/turns_drop_rate_longest"],
        "turns_drop_rate_shortest": values["buffer/turns_drop_rate_shortest"],
        "len_drop_rate_longest": values["buffer/len_drop_rate_longest"],
        "staleness_mean": float(np.mean([run["buffer/staleness_mean"] for run in runs])),
        "staleness_max": max(run["buffer/staleness_max"] for run in runs),
        "samples_per_s": sum(run["buffer/trained"] for run in runs) / sum(run["sim_s"] for run in runs),
        "by_turns": by_bucket(counts, "turns", bucket_names(turn_edges)),
        "by_length": by_bucket(counts, "len", bucket_names(edges)),
    }


def run_mode(mode: str, seeds: list[int], steps: int, regime: tuple[float, float]) -> dict[str, Any]:
    runs = [EpisodeSimulation(mode, seed, steps, regime).run() for seed in seeds]
    figures = pooled(runs)
    rates = " ".join(
        f"{name}:{row['drop_rate']:.0%}" for name, row in figures["by_turns"].items() if row["drop_rate"] is not None
    )
    print(
        f"{mode:>12}: dropped {figures['dropped_share']:.1%}; drop rate by turns {rates}; turns generated "
        f"{figures['turns_generated_mean']:.2f} trained {figures['turns_trained_mean']:.2f}; staleness "
        f"{figures['staleness_mean']:.2f} (max {figures['staleness_max']})",
        flush=True,
    )
    return {**figures, "runs": [{"seed": seed, "metrics": run} for seed, run in zip(seeds, runs)]}


HEADLINE_KEYS = (
    "dropped_share",
    "turns_drop_rate_longest",
    "turns_drop_rate_shortest",
    "len_drop_rate_longest",
    "turns_generated_mean",
    "turns_trained_mean",
    "staleness_mean",
    "staleness_max",
)


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """Per regime and mode, the pooled figures of HEADLINE_KEYS and the drop rate per turn bucket."""
    return {
        regime: {
            mode: {
                **{key: figures[key] for key in HEADLINE_KEYS},
                "drop_rate_by_turns": {name: row["drop_rate"] for name, row in figures["by_turns"].items()},
            }
            for mode, figures in values["modes"].items()
        }
        for regime, values in result["regimes"].items()
    }


def main(argv: list[str] | None = None) -> int:
    args = length_bias.parse_args(argv, __doc__.split("\n")[0])
    started = time.perf_counter()
    regimes: dict[str, dict[str, Any]] = {}
    for regime, (token_s, env_s) in REGIMES.items():
        longest = MAX_TURNS * (START_S + token_s * TURN_MAX_TOKENS + env_s) / length_bias.STEP_S
        typical = MAX_TURNS * (START_S + token_s * TURN_TOKENS + env_s) / length_bias.STEP_S
        print(
            f"{regime}: {MAX_TURNS} turns take {typical:.2f} learner steps typically, {longest:.2f} at most (η {ETA})"
        )
        regimes[regime] = {"token_s": token_s, "env_s": env_s, "max_turns_steps": [typical, longest]}
        regimes[regime]["modes"] = {mode: run_mode(mode, args.seeds, args.steps, (token_s, env_s)) for mode in MODES}
    elapsed = time.perf_counter() - started
    print(f"{len(REGIMES) * len(MODES) * len(args.seeds)} runs of {args.steps} steps in {elapsed:.1f} s")
    model = {
        "max_turns": MAX_TURNS,
        "max_total_tokens": MAX_TOTAL_TOKENS,
        "turn_max_tokens": TURN_MAX_TOKENS,
        "turn_tokens": TURN_TOKENS,
        "env_tokens": ENV_TOKENS,
        "group_size": GROUP_SIZE,
        "groups_per_step": length_bias.GROUPS_PER_STEP,
        "max_staleness": ETA,
        "generators": length_bias.GENERATORS,
        "slots": SLOTS,
        "step_s": length_bias.STEP_S,
        "start_s": START_S,
    }
    result = {"steps": args.steps, "seeds": args.seeds, "model": model, "regimes": regimes}
    save("length_bias_episodes", {"headline": headline(result), **result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
