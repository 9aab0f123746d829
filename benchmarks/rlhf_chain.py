"""The RLHF chain of examples/rlhf, start to end, and the figures issue 15 asks of it.

    .venv/bin/python -m benchmarks.rlhf_chain                        # the whole chain in a fresh runs/bench-rlhf-<t>
    .venv/bin/python -m benchmarks.rlhf_chain --root /tmp/rlhf       # ... in a root of your choice
    .venv/bin/python -m benchmarks.rlhf_chain --root /tmp/rlhf --report-only   # read a chain that already ran

Runs `examples/rlhf/chain.sh` (SFT -> RM -> PPO on the learned RM, DPO from the same SFT model, then `tandem eval`
of the base, SFT, PPO and DPO models on held-out prompts), timing each stage, and reads back:
  - the reward model's pairwise accuracy on held-out pairs (`tandem rm`'s summary.json; target >= RM_TARGET);
  - the verifier's accuracy (common.tasks.arithmetic_reward: strict = the answer after the '####' marker, lenient
    = the last number) of each model on held-out prompts, from `tandem eval`, never from the reward model; the
    PPO model's strict accuracy must beat the SFT model's by >= GAIN_TARGET, and DPO's must beat it too;
  - beside it the reward model's mean score of the same completions, and, from the PPO run's own metrics, the
    first and last reward/reward_model against reward/correct, so that reward hacking (RM score up, verifier
    flat) would show.
Writes results/rlhf_chain.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save, side_by_side
from common.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
CHAIN = REPO / "examples" / "rlhf" / "chain.sh"
STAGES = ("sft", "rm", "ppo", "dpo", "eval")
RM_TARGET = 0.9
GAIN_TARGET = 0.15
EVAL_SET = "arithmetic"  # held-out single-digit additions (common.eval_sets)
MODELS = ("base", "sft", "ppo", "dpo")  # the order chain.sh passes them to `tandem eval`


def run_chain(root: Path) -> dict[str, float]:
    """Run chain.sh stage by stage in `root`; returns each stage's wall seconds. A failing stage ends it."""
    tandem = str(Path(sys.executable).parent / "tandem")
    seconds = {}
    for stage in STAGES:
        start = time.perf_counter()
        print(f"== {stage}", flush=True)
        subprocess.run(
            ["bash", str(CHAIN), str(root)], env={**os.environ, "STAGES": stage, "TANDEM": tandem}, check=True
        )
        seconds[stage] = time.perf_counter() - start
    return seconds


def _last_eval(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def first_last(records: list[dict[str, Any]], key: str, share: float = 0.2) -> tuple[float | None, float | None]:
    """Mean of `key` over the first and the last `share` of the records that have it."""
    values = [r[key] for r in records if key in r]
    if not values:
        return None, None
    n = max(1, round(len(values) * share))
    return sum(values[:n]) / n, sum(values[-n:]) / n


def report(root: Path, seconds: dict[str, float] | None) -> dict[str, Any]:
    rm = _last_eval(root / "rlhf-rm")
    dpo = _last_eval(root / "rlhf-dpo")
    evaluation = json.loads((root / "rlhf-eval.json").read_text())
    by_model = dict(zip(MODELS, evaluation["models"].values(), strict=True))
    figures = {name: {"path": model["path"], "sets": model["sets"]} for name, model in by_model.items()}
    strict = {name: by_model[name]["sets"][EVAL_SET]["strict_accuracy"] for name in MODELS}
    lenient = {name: by_model[name]["sets"][EVAL_SET]["lenient_accuracy"] for name in MODELS}
    rm_score = {name: by_model[name]["sets"][EVAL_SET].get("rm_score") for name in MODELS}
    ppo_records = read_metrics(root / "rlhf-ppo" / "metrics.jsonl")
    ppo_rm = first_last(ppo_records, "reward/reward_model")
    ppo_correct = first_last(ppo_records, "reward/correct")
    rm_accuracy = rm["last_eval"]["eval/rm/accuracy"]
    headline = {
        "eval_set": EVAL_SET,
        "settings": evaluation["settings"],
        "rm_heldout_pairwise_accuracy": rm_accuracy,
        "rm_target": RM_TARGET,
        "rm_met": rm_accuracy >= RM_TARGET,
        "verifier_strict_accuracy": strict,
        "verifier_lenient_accuracy": lenient,
        "rm_score": rm_score,
        "ppo_gain_over_sft": strict["ppo"] - strict["sft"],
        "dpo_gain_over_sft": strict["dpo"] - strict["sft"],
        "gain_target": GAIN_TARGET,
        "ppo_met": strict["ppo"] - strict["sft"] >= GAIN_TARGET,
        "dpo_met": strict["dpo"] > strict["sft"],
        "ppo_training_reward_model_first_last": ppo_rm,
        "ppo_training_verifier_correct_first_last": ppo_correct,
        "dpo_heldout_accuracy": dpo["last_eval"].get("eval/dpo/accuracy"),
        "stage_minutes": None if seconds is None else {k: round(v / 60, 2) for k, v in seconds.items()},
        "chain_minutes": None if seconds is None else round(sum(seconds.values()) / 60, 2),
    }
    curves = {
        "rm_eval_accuracy": [
            (r["step"], r["eval/rm/accuracy"])
            for r in read_metrics(root / "rlhf-rm" / "metrics.jsonl")
            if "eval/rm/accuracy" in r
        ],
        "ppo_reward_model": [(r["step"], r.get("reward/reward_model")) for r in ppo_records],
        "ppo_verifier_correct": [(r["step"], r.get("reward/correct")) for r in ppo_records],
    }
    return {"root": str(root), "headline": headline, "models": figures, "curves": curves}


def plot(result: dict[str, Any]):
    def draw(axes: Any) -> None:
        bars, ppo = side_by_side(axes, 2, width=11)
        headline = result["headline"]
        names = list(headline["verifier_strict_accuracy"])
        xs = range(len(names))
        bars.bar([x - 0.2 for x in xs], [headline["verifier_strict_accuracy"][n] for n in names], 0.4, label="strict")
        bars.bar([x + 0.2 for x in xs], [headline["verifier_lenient_accuracy"][n] for n in names], 0.4, label="lenient")
        bars.set_xticks(list(xs), names)
        bars.set_ylabel(f"verifier accuracy, held-out '{headline['eval_set']}'")
        bars.legend()
        steps = [s for s, _ in result["curves"]["ppo_reward_model"]]
        ppo.plot(steps, [v for _, v in result["curves"]["ppo_reward_model"]], label="reward model score")
        ppo.plot(steps, [v for _, v in result["curves"]["ppo_verifier_correct"]], label="verifier: correct")
        ppo.set_xlabel("PPO step")
        ppo.set_title("PPO on the learned reward (training batches)")
        ppo.legend()

    return draw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO / "runs" / f"bench-rlhf-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--report-only", action="store_true", help="read a chain that already ran in --root")
    args = parser.parse_args()
    seconds = None if args.report_only else run_chain(args.root)
    result = report(args.root, seconds)
    save("rlhf_chain", result, plot(result))
    print(json.dumps(result["headline"], indent=2))


if __name__ == "__main__":
    main()
