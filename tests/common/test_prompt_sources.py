"""Datasets as users have them (common/prompt_sources.py) and reward routing (common/reward_routing.py).

.venv/bin/python -m pytest tests/common/test_prompt_sources.py -q -p no:cacheprovider
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.config import ConfigError, EnvConfig, load_config
from common.prompt_sources import (
    MAX_MIX_PROMPTS,
    MAX_WEIGHT_PERIOD,
    RowMapping,
    integer_weights,
    load_env_prompts,
    load_source,
    mix_plan,
    record_from_row,
    weighted_round_robin,
)
from common.reward_routing import RoutedReward, reward_fn_for

BOXED = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}."


def verl_rows(n: int, data_source: str = "openai/gsm8k") -> list[dict]:
    """Rows in veRL's parquet schema, as its examples/data_preprocess/gsm8k.py writes them."""
    return [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": f"What is {i} + 1? Let's think step by step."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"split": "train", "index": i, "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"},
        }
        for i in range(n)
    ]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def env(**fields) -> EnvConfig:
    return EnvConfig(kind="file", **fields)


# ------------------------------------------------------------------------------------------ the shapes read


def test_verl_parquet_reads_as_it_is(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "train.parquet", verl_rows(3))
    records = load_env_prompts(env(source=str(path)), seed=0)
    assert [r.prompt_id for r in records] == [0, 1, 2]
    first = records[1]
    assert first.messages == [{"role": "user", "content": "What is 1 + 1? Let's think step by step."}]
    assert first.metadata == {
        "data_source": "openai/gsm8k",
        "ability": "math",
        "answer": "2",  # from reward_model.ground_truth: label_key "answer" names nothing in a veRL row
        "reward_model.style": "rule",
        "extra_info.split": "train",
        "extra_info.index": 1,
        "extra_info.answer": "1 + 1 = 2\n#### 2",
    }


def test_openrlhf_jsonl_string_and_chat_input(tmp_path: Path) -> None:
    rows = [
        {"input": "What is 2 + 2?", "label": 4},
        {"input": [{"role": "user", "content": "What is 3 + 3?"}], "label": "6", "tags": ["a", "b"]},
    ]
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    records = load_env_prompts(env(source=str(path), prompt_key="input", label_key="label"), seed=0)
    assert records[0].messages == [{"role": "user", "content": "What is 2 + 2?"}]
    assert records[0].metadata == {"answer": 4}
    assert records[1].messages == [{"role": "user", "content": "What is 3 + 3?"}]
    assert records[1].metadata == {"answer": "6", "tags": '["a", "b"]'}  # a list: one JSON string


def test_nested_prompt_and_label_keys(tmp_path: Path) -> None:
    row = {"extra_info": {"question": "Q?", "index": 7, "meta": {"hard": True}}, "reward_model": {"truth": [1, 2]}}
    mapping = RowMapping(prompt_key="extra_info.question", label_key="reward_model.truth")
    record = record_from_row(row, 0, "f.jsonl, line 1", mapping)
    assert record.messages == [{"role": "user", "content": "Q?"}]
    assert record.metadata == {"extra_info.index": 7, "extra_info.meta.hard": True, "answer": "[1, 2]"}


def test_template_and_system_prompt(tmp_path: Path) -> None:
    chat = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "What is 1 + 1?"},
    ]
    mapping = RowMapping(prompt_template=BOXED, system_prompt="You are careful.")
    record = record_from_row({"prompt": chat}, 0, "w", mapping)
    assert record.messages[0] == {"role": "system", "content": "You are careful."}
    assert record.messages[1:3] == chat[:2]  # only the last user message is templated
    assert record.messages[3]["content"] == (
        "What is 1 + 1?\nPlease reason step by step, and put your final answer within \\boxed{}."
    )
    own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}]
    assert record_from_row({"messages": own}, 0, "w", mapping).messages[0] == own[0]  # its own system kept


# ------------------------------------------------------------------------------------------ bad rows


def test_missing_prompt_names_file_row_keys_and_the_key_to_set(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"question": "Q", "answer": 1}])
    with pytest.raises(ValueError) as caught:
        load_source(str(path), RowMapping())
    message = str(caught.value)
    assert "\n" not in message
    assert f"{path}, line 2" in message and "['answer', 'question']" in message and "env.prompt_key" in message


def test_bad_parquet_row_names_its_row(tmp_path: Path) -> None:
    rows = [{"prompt": "fine", "n": 1}, {"prompt": None, "n": 2}]
    path = write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(ValueError, match=r"d\.parquet, row 1: no prompt"):
        load_source(str(path), RowMapping())


def test_prompt_neither_string_nor_chat() -> None:
    with pytest.raises(ValueError, match=r"w: 'prompt' must be a string or a list of \{role, content\}"):
        record_from_row({"prompt": 3}, 0, "w", RowMapping())
    with pytest.raises(ValueError, match="both 'prompt' and 'messages'"):
        record_from_row({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 0, "w", RowMapping())


# ------------------------------------------------------------------------------------------ mixing


@pytest.mark.parametrize("weights", [[1.0, 1.0], [0.3, 0.7], [3.0, 1.0, 2.0], [0.25, 0.5, 0.125, 0.125]])
def test_round_robin_prefix_bound(weights: list[float]) -> None:
    """After t picks, -1 < t * w_i / W - count_i(t) < n - 1 (the bound proved in weighted_round_robin) at every
    t of 40 periods, and the counts are exact at each multiple of W."""
    ints = integer_weights(weights)
    total, n = sum(ints), len(ints)
    order = weighted_round_robin(ints) * 40
    counts = [0] * n
    for t, source in enumerate(order, start=1):
        counts[source] += 1
        for i in range(n):
            lag = t * ints[i] - total * counts[i]  # W times (t * w_i / W - count_i): integers, exact
            assert -total < lag < (n - 1) * total
        if t % total == 0:
            assert counts == [t // total * w for w in ints]


def test_integer_weights_read_the_decimals_written() -> None:
    assert integer_weights([0.3, 0.7]) == [3, 7]
    assert integer_weights([2, 2, 4]) == [1, 1, 2]
    with pytest.raises(ValueError):
        integer_weights([1.0, 0.0])


def test_mix_epoch_covers_every_source_at_its_exact_share() -> None:
    sizes, weights = [10, 7], [3.0, 1.0]
    plan = mix_plan(sizes, weights, seed=5)
    # k = max(ceil(10 / 3), ceil(7 / 1)) = 7 periods of 4: 28 records, 21 from source 0 and 7 from source 1
    assert len(plan) == 28
    assert Counter(s for s, _ in plan) == {0: 21, 1: 7}
    rows0 = Counter(row for s, row in plan if s == 0)
    assert set(rows0) == set(range(10)) and sorted(rows0.values()) == [2] * 9 + [3]  # 21 = two cycles + 1 row
    assert sorted(row for s, row in plan if s == 1) == list(range(7))  # exactly once
    assert mix_plan(sizes, weights, seed=5) == plan
    assert mix_plan(sizes, weights, seed=6) != plan  # which row repeats is the seed's choice


def test_mixed_ids_stable_across_reloads(tmp_path: Path) -> None:
    gsm = write_parquet(tmp_path / "gsm8k.parquet", verl_rows(5))
    other = write_jsonl(tmp_path / "other.jsonl", [{"prompt": f"p{i}", "answer": i} for i in range(3)])
    config = env(sources=[{"source": str(gsm), "weight": 1}, {"source": str(other), "weight": 1}])
    first = load_env_prompts(config, seed=3)
    again = load_env_prompts(config, seed=3)
    assert [r.to_dict() for r in first] == [r.to_dict() for r in again]
    assert [r.prompt_id for r in first] == list(range(10))
    assert Counter(r.metadata["data_source"] for r in first) == {"openai/gsm8k": 5, "other": 5}  # name = stem


def test_weights_far_apart_are_refused() -> None:
    with pytest.raises(ValueError, match="integer ratio"):
        mix_plan([10, 10], [0.333333, 0.666667], seed=0)
    assert MAX_WEIGHT_PERIOD < 1_000_000
    # 2,000,001 rows beside 1 at equal weights: k = 2,000,001 periods of 2 = 4,000,002 prompts, just over the cap;
    # refused before a record is built
    with pytest.raises(ValueError, match=r"an epoch of this mix is 4,000,002 prompts"):
        mix_plan([2_000_001, 1], [1, 1], seed=0)
    assert MAX_MIX_PROMPTS == 4_000_000


# ------------------------------------------------------------------------------------------ reward routing


def _gsm_reward(completion: str, metadata: dict) -> float:
    return 1.0


def _other_reward(completion: str, metadata: dict, *, bonus: float = 0.0) -> dict[str, float]:
    return {"other": 2.0 + bonus}


def test_routes_by_data_source_and_by_source() -> None:
    config = env(
        sources=[
            {"source": "a.parquet"},
            {
                "source": "b.jsonl",
                "name": "b",
                "reward_fn": f"{__name__}:_other_reward",
                "reward_fn_args": {"bonus": 1},
            },
        ],
        reward_fns={"openai/gsm8k": f"{__name__}:_gsm_reward"},
        reward_fn="arithmetic",
    )
    score = reward_fn_for(config)
    assert isinstance(score, RoutedReward)
    assert score("x", {"data_source": "openai/gsm8k"}) == 1.0
    assert score("x", {"data_source": "b"}) == {"other": 3.0}
    assert score("#### 4", {"data_source": "elsewhere", "answer": 4})["correct"] == 1.0  # the default
    assert score("#### 4", {"answer": 4})["correct"] == 1.0  # no data_source: the default


def test_unrouted_data_source_without_default_is_a_clear_error() -> None:
    score = RoutedReward({"a": _gsm_reward}, None)
    with pytest.raises(KeyError, match="no reward function for data_source 'b'.*env.reward_fns"):
        score("x", {"data_source": "b"})


def test_without_routes_the_plain_function_comes_back() -> None:
    assert reward_fn_for(env(source="x.jsonl", reward_fn=f"{__name__}:_gsm_reward")) is _gsm_reward


def test_load_refuses_rows_no_route_scores(tmp_path: Path) -> None:
    gsm = write_parquet(tmp_path / "gsm.parquet", verl_rows(2))
    routed_by_source = env(sources=[{"source": str(gsm), "reward_fn": "arithmetic"}])
    with pytest.raises(ValueError, match=r"rows carry data_source \['openai/gsm8k'\].*env.reward_fns"):
        load_env_prompts(routed_by_source, seed=0)
    unrouted = env(source=str(gsm), reward_fn="", reward_fns={"other": "arithmetic"})
    with pytest.raises(ValueError, match=r"no route scores rows of data_source \['openai/gsm8k'\]"):
        load_env_prompts(unrouted, seed=0)


# ------------------------------------------------------------------------------------------ config refusals


SOURCE_A = '[[env.sources]]\nsource = "a.jsonl"\n'


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('[[env.sources]]\nsource = "a.jsonl"\nwieght = 2\n', "env.sources.0.wieght"),
        ('[[env.sources]]\nsource = "a.jsonl"\nweight = 0\n', "greater than 0"),
        ('[[env.sources]]\nsource = "a.jsonl"\nweight = -1.5\n', "greater than 0"),
        ('[env]\nkind = "file"\nsource = "b.jsonl"\n' + SOURCE_A, "keep one"),
        ('[env]\nkind = "arithmetic"\n' + SOURCE_A, "kind = 'file'"),
        ('[env]\nkind = "file"\nsource = "b.jsonl"\nprompt_template = "no placeholder"\n', "must contain {prompt}"),
        (SOURCE_A + "weight = 0.333333\n" + '[[env.sources]]\nsource = "b.jsonl"\n', "integer ratio"),
        (SOURCE_A + 'reward_fn = "math"\n[[env.sources]]\nsource = "x/a.jsonl"\nreward_fn = "arithmetic"\n', "names"),
    ],
)
def test_config_refusals(tmp_path: Path, toml: str, expected: str) -> None:
    if "[env]" not in toml:
        toml = '[env]\nkind = "file"\n' + toml
    path = tmp_path / "run.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=expected.replace("{", r"\{").replace("}", r"\}")):
        load_config(path, [])


def test_sources_config_accepted(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        '[env]\nkind = "file"\nreward_fns = {"openai/gsm8k" = "math"}\n'
        '[[env.sources]]\nsource = "gsm8k.parquet"\nweight = 0.7\n'
        '[[env.sources]]\nsource = "math.jsonl"\nweight = 0.3\nprompt_key = "problem"\nlabel_key = "solution"\n'
    )
    config = load_config(path, [])
    assert [(s.source, s.weight, s.prompt_key) for s in config.env.sources] == [
        ("gsm8k.parquet", 0.7, None),
        ("math.jsonl", 0.3, "problem"),
    ]


# ------------------------------------------------------------------------------------------ start-up check


def test_start_up_check_reads_the_first_rows_of_every_source(tmp_path: Path) -> None:
    from launch.config_checks import missing_paths

    good = write_parquet(tmp_path / "gsm8k.parquet", verl_rows(3))
    bad = write_jsonl(tmp_path / "math.jsonl", [{"problem": "ok", "solution": "1"}, {"question": "Q"}])
    path = tmp_path / "run.toml"
    sources = f'[[env.sources]]\nsource = "{good}"\n[[env.sources]]\nsource = "{bad}"\nprompt_key = "problem"\n'
    path.write_text('[env]\nkind = "file"\n' + sources)
    problems = missing_paths(load_config(path, []), "buffer")
    assert any(p.startswith(f"env.sources[1].source: {bad}, line 2: no prompt") for p in problems), problems
    path.write_text('[env]\nkind = "file"\n' + sources.replace(str(bad), str(tmp_path / "nope.jsonl")))
    problems = missing_paths(load_config(path, []), "buffer")
    assert any(p.startswith("env.sources[1].source: ") and "does not exist" in p for p in problems), problems
    bad.write_text('{"problem": "ok", "solution": "1"}\n')
    path.write_text('[env]\nkind = "file"\n' + sources)
    assert not [p for p in missing_paths(load_config(path, []), "buffer") if p.startswith("env.")]


def test_eval_file_set_is_read_with_the_runs_mapping(tmp_path: Path) -> None:
    from common.eval_sets import eval_set
    from common.prompt_sources import env_row_mapping

    path = write_jsonl(tmp_path / "test.jsonl", [{"problem": "What is 1 + 1?", "solution": "\\boxed{2}"}] * 3)
    config = env(source=str(path), prompt_key="problem", label_key="solution", prompt_template=BOXED)
    records = eval_set(f"file:{path}", limit=2, mapping=env_row_mapping(config)).records
    assert len(records) == 2
    assert records[0].messages[-1]["content"].endswith("within \\boxed{}.")
    assert records[0].metadata == {"answer": "\\boxed{2}"}
