"""sample_completions drives any Engine to the end: every prompt's k completions, in order, none lost."""

from __future__ import annotations

import pytest

from actors.engine.offline_sampling import sample_completions
from actors.engine.simulated import SimEngine
from common.eval_sets import eval_set


def test_every_prompt_gets_its_samples_from_a_batching_engine() -> None:
    engine = SimEngine(sim_tokens=3, sim_token_s=0.0, max_num_seqs=5, seed=0)  # 12 requests through 5 slots
    records = eval_set("arithmetic", limit=4).records
    groups = sample_completions(engine, records, samples=3)
    assert [len(g) for g in groups] == [3, 3, 3, 3]
    assert all(
        c.num_tokens == 3 and c.finish_reason == "length" and len(c.text.split()) == 3 for g in groups for c in g
    )
    assert engine.num_unfinished() == 0


def test_samples_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="samples must be >= 1"):
        sample_completions(SimEngine(1, 0.0, 1, 0), [], samples=0)
