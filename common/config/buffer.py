"""`[buffer]`: the replay buffer's capacity, admission, persistence and address."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    Field,
    model_validator,
)

from common.config.base import MAX_TIMEOUT_S, Host, _Section


class BufferConfig(_Section):
    """The buffer service: prompt leases, the replay buffer, the staleness bound, batches."""

    host: Host = Field(
        "127.0.0.1",
        description="Address the buffer binds (loopback by default; any other needs run.curve_keys_dir or "
        "run.insecure).",
    )
    port: int = Field(
        5555, description="Port of the buffer's request socket (unset: run.port_base, else 5555).", ge=1, le=65535
    )
    capacity: int = Field(4096, description="Replay capacity in samples; oldest groups are evicted first.", ge=1)
    max_reuse: int = Field(1, description="Times a sample may be trained on.", ge=1)
    sampling: Literal["auto", "fifo", "uniform", "oldest_first"] = Field(
        "auto",
        description="Order in which groups are drawn: `fifo` by arrival, `uniform` at random (seeded), "
        "`oldest_first` the oldest policy version first, ties in lease order (earliest deadline first: long "
        "completions arrive last with older versions, and fifo lets them reach the staleness bound and be "
        "dropped; `buffer/len_*` metrics measure it, `benchmarks/length_bias.py` compares); `auto`: "
        "`oldest_first` with env.environment (an episode is as stale as its first turn, so the long ones reach "
        "the bound: `benchmarks/length_bias_episodes.py`, docs/algorithms.md), else `fifo`.",
    )
    lease_timeout_s: float = Field(
        300.0,
        description="A lease that no heartbeat of its generator listed for this long is re-issued. Not a cap on "
        "rollout length: a live generator's heartbeats (sent from a thread of their own, whatever one engine step "
        "or environment call takes) renew its leases for as long as it makes progress (stall_timeout_s).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    heartbeat_timeout_s: float = Field(
        30.0,
        description="A generator silent this long is presumed dead; its leases are re-issued.",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    stall_timeout_s: float = Field(
        900.0,
        description="A generator that heartbeats but shows no progress (no engine step that ran a request, no "
        "sample finished, no environment call answered) for this long while holding leases is stuck: its leases "
        "are re-issued (counted: generators_stuck). Keep it above the longest single engine step and the longest "
        "environment call (env.step_timeout_s).",
        gt=0,
        le=MAX_TIMEOUT_S,
    )
    persist: bool = Field(False, description="Append accepted groups and lease/cursor state to a log in the run dir.")
    epochs: int = Field(0, description="Passes over the prompts (0 = unlimited).", ge=0)
    vocab_size: int = Field(
        0,
        description="Token ids a group may hold are [0, vocab_size); 0 = the model's (`vocab_size` of model.path's "
        "config.json; 49152 for `smollm2` and `tiny`). Groups with other ids are rejected (counted: bad_token).",
        ge=0,
        le=2**31,  # token ids travel as int32
    )
    max_abs_reward: float = Field(
        1e6,
        description="Rewards and reward components must be finite and within [-max_abs_reward, max_abs_reward]; "
        "other groups are rejected (counted: bad_reward). The default is far above any task's reward and keeps "
        "every float32 statistic the learner takes (group variance, squared critic errors summed over a batch: "
        "(2e6)^2 x 2^27 tokens ~ 5e20) far below float32's 3.4e38.",
        gt=0,
        allow_inf_nan=False,
    )
    filter: Literal["none", "no_signal"] = Field(
        "none",
        description="Dynamic sampling (DAPO). none: every valid group is stored. no_signal: a group whose rewards "
        "carry no signal (max - min <= min_reward_spread, within 4 float32 ulps of the largest |reward|) is dropped "
        "at arrival and counted as dropped_no_signal (its prompt is done), and admission leases more prompts so "
        "batches still fill (each outstanding prompt counts at the recent share that carried signal).",
    )
    min_reward_spread: float = Field(
        0.0,
        description="With filter = no_signal: a group is dropped when max(reward) - min(reward) <= this (0 = only "
        "groups whose rewards are all equal).",
        ge=0,
        allow_inf_nan=False,
    )
    max_filtered_share: float = Field(
        0.9,
        description="With filter = no_signal: warn (once per filter_window groups) when more than this share of "
        "the last filter_window groups was filtered; admission also assumes at most this share, which bounds the "
        "prompts outstanding at 1 / (1 - max_filtered_share) times the unfiltered quota.",
        gt=0,
        lt=1,
    )
    filter_window: int = Field(
        32,
        description="With filter = no_signal: the last arrivals (groups) over which the filtered share is "
        "estimated, for admission and the warning.",
        ge=1,
        le=1_000_000,
    )
    curriculum: Literal["none", "pass_rate"] = Field(
        "none",
        description="Which prompts to lease. none: epochs in a seeded permutation. pass_rate: by each prompt's pass "
        "rate in its last group (buffers.curriculum): prompts whose groups carry signal (curriculum_low < rate < "
        "curriculum_high) and new ones share the draws (curriculum_signal_share), least drawn first; the easy and "
        "hard pools are revisited for a share curriculum_revisit of the draws, so none is starved. Admission (how many) and eta are unchanged; with "
        "epochs > 0 the run draws epochs x prompts.",
    )
    curriculum_low: float = Field(
        0.0, description="With curriculum = pass_rate: a prompt whose pass rate is <= this is hard.", ge=0, lt=1
    )
    curriculum_high: float = Field(
        1.0, description="With curriculum = pass_rate: a prompt whose pass rate is >= this is easy.", gt=0, le=1
    )
    curriculum_revisit: float = Field(
        0.1,
        description="With curriculum = pass_rate: the share of draws that go to the easy and hard pools (half each) "
        "so that a prompt learnt or forgotten since changes pool.",
        ge=0,
        le=1,
    )
    curriculum_signal_share: float = Field(
        0.5,
        description="With curriculum = pass_rate: of the draws that are not revisits, the share that goes to prompts "
        "whose last group had signal (in rotation); the rest go to prompts never tried. 0: new prompts first (the "
        "curriculum then acts only from the second pass over the data); 1: the signal prompts first.",
        ge=0,
        le=1,
    )
    curriculum_pass_reward: float = Field(
        1.0,
        description="A sample passes when its reward is >= this (the arithmetic reward's correct answer: 1.0, with "
        "or without the format bonus). Sets the pass rates of the curriculum and of the buffer/pass_* histograms, "
        "which are kept with the curriculum off too.",
        allow_inf_nan=False,
    )

    @model_validator(mode="after")
    def _curriculum_band(self) -> BufferConfig:
        if self.curriculum_low >= self.curriculum_high:
            raise ValueError(
                f"curriculum_low ({self.curriculum_low}) must be below curriculum_high ({self.curriculum_high})"
            )
        return self
