"""Workload C's environment (benchmarks/workloads/slow_checker.py): the checker's latency distribution and an
episode's turns and rewards."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from benchmarks.workloads import slow_checker
from benchmarks.workloads.slow_checker import RETRY, SlowCheckerEnv, lognormal_sigma

TASK = SimpleNamespace(
    messages=[{"role": "user", "content": "Mia has 9 shells and loses 4. How many now?"}],
    metadata={"answer": "Mia had 9 shells and lost 4, so she has 9 - 4 = 5 shells.\n#### 5"},
)


def test_latencies_have_the_median_and_the_99th_percentile_asked() -> None:
    SlowCheckerEnv.prepare(median_s=0.5, p99_s=10.0, seed=1)
    env = SlowCheckerEnv(median_s=0.5, p99_s=10.0, cap_s=50.0)
    draws = [env.latency_s() for _ in range(20000)]
    # shares of 20,000 independent draws: sd sqrt(p (1 - p) / n) = 0.0035 at p = 0.5 and 0.0007 at p = 0.01;
    # the bands are about 4 sd wide
    assert abs(sum(d < 0.5 for d in draws) / len(draws) - 0.5) < 0.015
    assert abs(sum(d > 10.0 for d in draws) / len(draws) - 0.01) < 0.003
    assert max(draws) <= 50.0
    assert lognormal_sigma(0.5, 10.0) == pytest.approx(1.2878, abs=1e-4)


def test_a_wrong_first_answer_gets_one_retry_and_half_the_reward() -> None:
    SlowCheckerEnv.prepare(median_s=0.001, p99_s=0.01, cap_s=0.02)
    env = SlowCheckerEnv(median_s=0.001, p99_s=0.01, cap_s=0.02)
    assert env.reset(TASK) == TASK.messages
    first = asyncio.run(env.step("9 - 4 = 6\n#### 6"))
    assert not first.done and first.reward == 0.0 and first.observation == [{"role": "user", "content": RETRY}]
    second = asyncio.run(env.step("9 - 4 = 5\n#### 5"))
    assert second.done and second.reward == 0.5
    assert second.info["components"] == {"first_try": 0.0, "retry": 0.5}
    env.reset(TASK)
    right = asyncio.run(env.step("#### 5"))
    assert right.done and right.reward == 1.0 and right.info["components"] == {"first_try": 1.0, "retry": 0.0}
    env.reset(TASK)
    asyncio.run(env.step("#### 1"))
    wrong = asyncio.run(env.step("#### 2"))
    assert wrong.done and wrong.reward == 0.0 and wrong.info["components"] == {"first_try": 0.0, "retry": 0.0}


def test_bad_arguments_are_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="median_s < p99_s"):
        SlowCheckerEnv.prepare(median_s=2.0, p99_s=1.0)
    with pytest.raises(ValueError, match="attempts"):
        SlowCheckerEnv.prepare(attempts=0)
    assert slow_checker.Z_99 == pytest.approx(2.3263, abs=1e-4)
