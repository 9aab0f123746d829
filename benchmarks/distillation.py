"""On-policy distillation on the CPU: a teacher fine-tuned by the project's own SFT stage, distilled into the embedded
model on the student's own samples, and the held-out accuracy of the student before and after (and of the teacher).

    .venv/bin/python -m benchmarks.distillation                      # in a fresh runs/bench-distill-<t>
    .venv/bin/python -m benchmarks.distillation --root /tmp/distill --report-only   # read runs that already ran

The stages (each a `tandem` command, timed):
  1. teacher: `tandem sft examples/rlhf/sft.toml` with SFT_EXAMPLES chats (SmolLM2-135M-Instruct fine-tuned on
     correct replies that end "#### <answer>": the format the prompt asks for);
  2. distill: `tandem run examples/distill/distill.toml` from the untouched embedded model, with the teacher as
     algo.teacher_model and the teacher's term alone (algo.distill_alone: the task reward is logged, not trained on);
  3. control: the same run without the teacher, GRPO on the task reward (the verifier) from the same start;
  4. eval: `tandem eval` of the embedded model (the student before), the teacher, the distilled student and the
     control on the held-out arithmetic prompts (never trained on), EVAL_SAMPLES samples each at temperature 1,
     the verifier's strict accuracy (the answer after the marker) with its standard error over prompts.
From the distillation run's metrics: distill/reverse_kl, distill/teacher_logprob, policy/entropy and reward/correct
over the first and last quarter of the steps.
Writes results/distillation.{json,png}; headline keys: heldout_strict_accuracy {student_before, teacher,
student_after, grpo_control}, strict_stderr (over prompts), gain, control_gain, share_of_teacher_gap_closed,
reverse_kl_first_last, reward_correct_first_last, teacher_logprob_first_last, entropy_first_last, steps,
stage_minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, save, side_by_side
from benchmarks.rlhf_chain import first_last
from common.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
SFT_CONFIG = REPO / "examples" / "rlhf" / "sft.toml"
DISTILL_CONFIG = REPO / "examples" / "distill" / "distill.toml"
SFT_EXAMPLES = 96  # examples/rlhf/sft.toml: 96 chats reach ~0.875 held-out strict, a teacher worth distilling
EVAL_SET = "arithmetic"
EVAL_SAMPLES = 8  # the held-out single-digit set has 19 prompts: more samples per prompt, a steadier mean
EVAL_PROMPTS = 200  # all of them
FIRST_LAST_SHARE = 0.25  # the first and last quarter of the steps (3 of 12)
MODELS = ("student_before", "teacher", "student_after", "grpo_control")  # the order `tandem eval` gets them


def run_stages(root: Path, steps: int | None) -> dict[str, float]:
    """Run the four stages in `root`; returns each stage's wall seconds. A failing stage raises."""
    tandem = str(Path(sys.executable).parent / "tandem")
    teacher = root / "distill-teacher" / "model"
    stages = {
        "teacher": [tandem, "sft", str(SFT_CONFIG), "--run.root", str(root), "--run.name", "distill-teacher"]
        + ["--sft.num_examples", str(SFT_EXAMPLES)],
        "distill": [tandem, "run", str(DISTILL_CONFIG), "--run.root", str(root), "--algo.teacher_model", str(teacher)]
        + ([] if steps is None else ["--learner.total_steps", str(steps)]),
        "control": [tandem, "run", str(DISTILL_CONFIG), "--run.root", str(root), "--run.name", "distill-control"]
        + ["--algo.teacher_model", "", "--algo.distill_alone", "false"]
        + ([] if steps is None else ["--learner.total_steps", str(steps)]),
        "eval": [tandem, "eval", "smollm2", str(teacher), str(root / "distill"), str(root / "distill-control")]
        + ["--sets", EVAL_SET]
        + ["--samples", str(EVAL_SAMPLES), "--temperature", "1.0", "--max-tokens", "32"]
        + ["--prompts", str(EVAL_PROMPTS), "--out", str(root / "distill-eval.json")],
    }
    seconds = {}
    for name, argv in stages.items():
        print(f"== {name}: {' '.join(argv)}", flush=True)
        start = time.perf_counter()
        subprocess.run(argv, cwd=REPO, check=True)
        seconds[name] = time.perf_counter() - start
    return seconds


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures issue 36 asks for, from the saved evaluation and metrics."""
    sets = {name: model["sets"][EVAL_SET] for name, model in result["models"].items()}
    strict = {name: sets[name]["strict_accuracy"] for name in MODELS}
    return {
        "eval_set": EVAL_SET,
        "heldout_strict_accuracy": strict,
        # tandem eval's: prompts as the units (a prompt's samples are not independent of each other)
        "strict_stderr": {name: sets[name]["strict_accuracy_stderr"] for name in MODELS},
        "gain": strict["student_after"] - strict["student_before"],
        "control_gain": strict["grpo_control"] - strict["student_before"],
        "share_of_teacher_gap_closed": (strict["student_after"] - strict["student_before"])
        / max(strict["teacher"] - strict["student_before"], 1e-9),
        "reverse_kl_first_last": result["curves"]["reverse_kl_first_last"],
        "reward_correct_first_last": result["curves"]["reward_correct_first_last"],
        "teacher_logprob_first_last": result["curves"]["teacher_logprob_first_last"],
        "entropy_first_last": result["curves"]["entropy_first_last"],
        "steps": result["steps"],
        "stage_minutes": result["stage_minutes"],
    }


def report(root: Path, seconds: dict[str, float] | None) -> dict[str, Any]:
    evaluation = json.loads((root / "distill-eval.json").read_text())
    by_model = dict(zip(MODELS, evaluation["models"].values(), strict=True))
    records = read_metrics(root / "distill" / "metrics.jsonl")
    result = {
        "root": str(root),
        "settings": evaluation["settings"],
        "models": {name: {"path": model["path"], "sets": model["sets"]} for name, model in by_model.items()},
        "steps": max((r["step"] for r in records if "step" in r), default=0),
        "stage_minutes": None if seconds is None else {k: round(v / 60, 2) for k, v in seconds.items()},
        "curves": {
            "reverse_kl": [(r["step"], r["distill/reverse_kl"]) for r in records if "distill/reverse_kl" in r],
            "reward_correct": [(r["step"], r["reward/correct"]) for r in records if "reward/correct" in r],
            "reverse_kl_first_last": first_last(records, "distill/reverse_kl", FIRST_LAST_SHARE),
            "reward_correct_first_last": first_last(records, "reward/correct", FIRST_LAST_SHARE),
            "teacher_logprob_first_last": first_last(records, "distill/teacher_logprob", FIRST_LAST_SHARE),
            "entropy_first_last": first_last(records, "policy/entropy", FIRST_LAST_SHARE),
        },
    }
    result["headline"] = headline(result)
    return result


def plot(result: dict[str, Any]):
    def draw(axes: Any) -> None:
        bars, curves = side_by_side(axes, 2, width=11)
        strict = result["headline"]["heldout_strict_accuracy"]
        errors = result["headline"]["strict_stderr"]
        bars.bar(list(strict), list(strict.values()), yerr=[errors[n] for n in strict], capsize=4)
        bars.set_ylabel(f"held-out strict accuracy ('{EVAL_SET}', T = 1)")
        kl = result["curves"]["reverse_kl"]
        correct = result["curves"]["reward_correct"]
        curves.plot([s for s, _ in kl], [v for _, v in kl], label="distill/reverse_kl (nats/token)")
        curves.plot([s for s, _ in correct], [v for _, v in correct], label="reward/correct (training samples)")
        curves.set_xlabel("learner step")
        curves.set_title("distillation run (teacher term alone)")
        curves.legend()

    return draw


def saved_seconds(root: Path) -> dict[str, float] | None:
    """The stage times of the saved result when it was measured in `root` (a report-only run keeps them)."""
    path = RESULTS / "distillation.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    if saved.get("root") != str(root) or not saved.get("stage_minutes"):
        return None
    return {stage: minutes * 60 for stage, minutes in saved["stage_minutes"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO / "runs" / f"bench-distill-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--steps", type=int, default=None, help="learner steps (default: the config's)")
    parser.add_argument("--report-only", action="store_true", help="read runs that already ran in --root")
    args = parser.parse_args()
    seconds = saved_seconds(args.root) if args.report_only else run_stages(args.root, args.steps)
    result = report(args.root, seconds)
    save("distillation", result, plot(result))
    print(json.dumps(result["headline"], indent=2))


if __name__ == "__main__":
    main()
