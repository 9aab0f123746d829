"""The learner's line for a long wait (`learners.stall_report`), from hand-made counters: nobody heard from,
generation too slow for one batch, groups refused and leases expired, everything dropped as stale, a buffer that
does not answer; and when the watch reports (threshold, repeats, a new step)."""

from __future__ import annotations

import dataclasses

from learners.stall_report import BatchNeeds, WaitWatch, duration, generation_rate, why_waiting

NEEDS = BatchNeeds(
    groups_per_step=4,
    group_size=8,
    max_tokens=128,  # 4 x 8 samples x 128 = 4,096 tokens a batch, at most
    generators=1,
    dtype="bfloat16",
    max_staleness=1,
    buffer_address="127.0.0.1:5555",
)
ALIVE = {"generators_alive": 1, "tokens_sampled": 0, "arrived": 0, "arrived_groups": 0, "buffered_groups": 0}


def test_durations() -> None:
    assert [duration(s) for s in (45, 370, 7380)] == ["45s", "6m10s", "2h03m"]


def test_no_generator_heard_from() -> None:
    counters = {**ALIVE, "generators_alive": 0}
    line = why_waiting(0, 400, NEEDS, counters, counters, 300)
    assert line.startswith("no batch for step 0 after 6m40s: no generator has been heard from")
    assert "127.0.0.1:5555" in line and "generator.count = 1" in line and "generator.buffer_address" in line


def test_generators_heard_before_but_none_alive_now() -> None:
    counters = {**ALIVE, "generators_alive": 0, "tokens_sampled": 5000, "generators_lost": 1}
    line = why_waiting(3, 200, NEEDS, counters, counters, 60)
    assert "no generator is alive" in line and "generators_lost 1" in line


def test_generation_too_slow_for_one_batch() -> None:
    before = dict(ALIVE)
    after = {**ALIVE, "tokens_sampled": 16 * 300}  # 16 tok/s over the window: bf16 emulated on an AVX2 CPU
    assert generation_rate(before, after, 300) == 16.0
    line = why_waiting(0, 2766, NEEDS, before, after, 300)
    assert "no batch for step 0 after 46m06s (0/4 groups buffered)" in line
    assert "generation 16.0 tok/s (1 generator alive)" in line
    assert (
        "32 samples (4 groups x 8), up to 4,096 tokens (generator.max_tokens = 128): up to ~4m16s at this rate" in line
    )
    for change in ("model.dtype = float32", "generator.max_tokens (128)", "learner.groups_per_step (4)"):
        assert change in line
    assert "more generators (generator.count = 1)" in line
    # float32 already: no dtype advice; the tokens of arrived samples replace the max_tokens bound
    arrived = {**after, "arrived": 16, "tokens_arrived": 16 * 64, "buffered_groups": 2}
    line = why_waiting(0, 2766, dataclasses.replace(NEEDS, dtype="float32"), before, arrived, 300)
    assert "model.dtype" not in line and "~2,048 tokens: ~2m08s" in line and "(2/4 groups buffered)" in line


def test_leases_expiring_and_groups_refused_name_the_counters() -> None:
    before = {**ALIVE, "rejected_unknown_lease": 5, "leases_expired": 1}
    after = {
        **ALIVE,
        "tokens_sampled": 73 * 60,
        "rejected_unknown_lease": 17,
        "rejected_bad_token": 1,
        "rejected_eval_stale": 9,  # eval rejections are not training groups refused
        "leases_expired": 4,
        "generators_lost": 2,
    }
    line = why_waiting(2, 600, NEEDS, before, after, 60)
    assert "groups refused: rejected_unknown_lease 12, rejected_bad_token 1" in line and "eval" not in line
    assert "leases_expired 3 (generators_lost 2)" in line
    assert "the buffer's log says why each group was refused" in line and "buffer.stall_timeout_s" in line


def test_everything_dropped_as_stale() -> None:
    before = {**ALIVE, "tokens_sampled": 10_000, "arrived": 64, "tokens_arrived": 4096}
    after = {**before, "tokens_sampled": 10_000 + 380 * 60, "arrived": 128, "tokens_arrived": 8192}
    after["dropped_stale"] = 64
    line = why_waiting(5, 300, NEEDS, before, after, 60)
    assert "generation 380.0 tok/s" in line and "~5s at this rate" in line
    assert "dropped_stale 64 samples (older than algo.max_staleness = 1 versions)" in line
    assert "a larger algo.max_staleness" in line and "to generate a batch faster" not in line  # fast enough


def test_alive_but_nothing_sampled_and_a_buffer_that_does_not_answer() -> None:
    line = why_waiting(0, 200, NEEDS, ALIVE, ALIVE, 60)
    assert "1 generator alive but no token sampled in the last 1m00s" in line
    line = why_waiting(0, 200, NEEDS, ALIVE, None, 60)
    assert "the buffer at 127.0.0.1:5555 does not answer" in line


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_watch_reports_past_the_threshold_then_every_repeat_and_restarts_with_a_step() -> None:
    clock, asked = Clock(), []

    def stats() -> dict[str, int]:
        asked.append(clock.now)
        return {**ALIVE, "tokens_sampled": int(16 * clock.now)}

    watch = WaitWatch(NEEDS, first_after_s=120, repeat_s=300, clock=clock)
    reports = []
    for t in range(5, 800, 5):  # a wait for step 0's batch, polled every 5 s (the buffer holds each request 5 s)
        clock.now = float(t)
        report = watch.waiting(0, t, stats)
        if report is not None:
            reports.append((t, report))
    assert [t for t, _ in reports] == [120, 420, 720] and asked == [5.0, 120.0, 420.0, 720.0]
    assert reports[0][1].values == {"learner/waiting_for_batch_s": 120.0, "generation/tokens_per_s": 16.0}
    assert "generation 16.0 tok/s" in reports[0][1].line
    watch.stepped(200.0)  # the batch came; a median step of 200 s puts the threshold at 600 s
    assert watch.threshold_s() == 600.0
    clock.now = 1000.0
    assert watch.waiting(1, 5, stats) is None and watch.waiting(1, 595, stats) is None
    assert watch.waiting(1, 600, stats) is not None
