"""examples/word_problems.toml: the demo's shape and budget on the embedded GSM8K-shaped task, scored by the math
verifier and evaluated on the held-out word problems of the level it trains on."""

from __future__ import annotations

from pathlib import Path

from common.config import load_config
from common.eval_sets import WORD_PROBLEMS_LEVEL, eval_set
from launch.cli import DEMO_CONFIG

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "word_problems.toml"


def test_the_recipe_trains_the_embedded_model_on_word_problems_like_the_demo() -> None:
    recipe, demo = load_config(RECIPE), load_config(DEMO_CONFIG)
    assert recipe.model.path == "smollm2" and recipe.env.kind == "word_problems"
    assert recipe.env.reward_fn == "math" and recipe.env.split == "train"
    assert recipe.eval.sets == ["word_problems"] and recipe.env.difficulty == WORD_PROBLEMS_LEVEL
    # the demo's budget: the same samples a step, steps, generator and learner counts
    for section, keys in {
        "algo": ("estimator", "group_size", "max_staleness"),
        "learner": ("groups_per_step", "total_steps", "world_size", "lr"),
        "generator": ("count", "temperature"),
    }.items():
        for key in keys:
            assert getattr(getattr(recipe, section), key) == getattr(getattr(demo, section), key), f"{section}.{key}"


def test_its_eval_set_asks_as_training_asks() -> None:
    recipe = load_config(RECIPE)
    records = eval_set("word_problems", limit=recipe.eval.max_prompts, shots=recipe.env.shots).records
    assert len(records) == recipe.eval.max_prompts
    assert len(records[0].messages) == 2 * recipe.env.shots + 1
    assert recipe.generator.max_tokens < recipe.model.max_model_len
