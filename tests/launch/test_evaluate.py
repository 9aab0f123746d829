"""`tandem eval`: what a MODEL argument names, the arguments refused before any engine starts, the table and JSON
from scripted completions (no vLLM), and one real run through vLLM on the tiny model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from actors.engine.api import FinishedSample
from launch import evaluate
from launch.evaluate import EvalUsageError, plan, render_table, resolve_eval_model, write_json

HF_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}


def _hf_dir(path: Path, config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config or HF_CONFIG))
    return path


def _checkpoint(run: Path, step: int, complete: bool = True) -> Path:
    step_dir = run / "checkpoints" / f"step-{step:06d}"
    _hf_dir(step_dir / "hf")
    if complete:
        (step_dir / "learner_state.json").write_text("{}")
    return step_dir


# ------------------------------------------------------------------------------------- model paths


def test_a_hugging_face_directory_is_itself(tmp_path: Path) -> None:
    model = _hf_dir(tmp_path / "m")
    assert resolve_eval_model(str(model)) == model


def test_a_checkpoint_names_its_hf_export(tmp_path: Path) -> None:
    step = _checkpoint(tmp_path / "run", 30)
    assert resolve_eval_model(str(step)) == step / "hf"


def test_a_run_directory_names_its_model_else_its_newest_complete_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _checkpoint(run, 10)
    _checkpoint(run, 20)
    _checkpoint(run, 30, complete=False)  # no learner_state.json: a crash left it
    (run / "config.json").write_text(json.dumps({"run": {"name": "run"}}))  # the resolved Tandem config: no HF one
    assert resolve_eval_model(str(run)) == run / "checkpoints" / "step-000020" / "hf"
    _hf_dir(run / "model")  # the offline stages' export wins
    assert resolve_eval_model(str(run)) == run / "model"


def test_models_that_cannot_be_evaluated_are_refused_saying_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(EvalUsageError, match="no such directory; give a Hugging Face directory, a checkpoint"):
        resolve_eval_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EvalUsageError, match="neither a Hugging Face directory"):
        resolve_eval_model(str(tmp_path / "empty"))
    (tmp_path / "bare" / "checkpoints").mkdir(parents=True)
    with pytest.raises(EvalUsageError, match="without model/ and without a complete checkpoint"):
        resolve_eval_model(str(tmp_path / "bare"))
    rm = _hf_dir(tmp_path / "rm", {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]})
    with pytest.raises(EvalUsageError, match="is a reward model .* give a reward model as --reward-model"):
        resolve_eval_model(str(rm))
    broken = _hf_dir(tmp_path / "run" / "checkpoints" / "step-000005.tmp" / "hf").parent
    with pytest.raises(EvalUsageError, match="incomplete checkpoint"):
        resolve_eval_model(str(broken))


# --------------------------------------------------------------------------------------- arguments


def test_a_float32_model_stays_float32_unless_a_config_says_otherwise(tmp_path: Path) -> None:
    """A float32 fine-tune cast to bfloat16 loses its updates (launch.evaluate._model_settings): with model.dtype
    `auto` (the default, with or without --config) a model saved in float32 keeps float32 and the others are run as
    `auto` chooses on the machine; an explicit model.dtype in --config wins for all."""
    fp32 = _hf_dir(tmp_path / "fp32", {**HF_CONFIG, "dtype": "float32"})
    bf16 = _hf_dir(tmp_path / "bf16", {**HF_CONFIG, "torch_dtype": "bfloat16"})
    unknown = _hf_dir(tmp_path / "fp16", {**HF_CONFIG, "dtype": "float16"})  # not a Tandem dtype: the default
    own = plan([str(fp32), str(bf16), str(unknown), "--sets", "arithmetic"])
    assert [evaluate._model_settings(own, d).dtype for d in own.models.values()] == ["float32", "auto", "auto"]
    auto = tmp_path / "auto.toml"
    auto.write_text("[model]\nmax_model_len = 512\n")
    given = plan([str(fp32), str(bf16), "--sets", "arithmetic", "--config", str(auto)])
    assert [evaluate._model_settings(given, d).dtype for d in given.models.values()] == ["float32", "auto"]
    config = tmp_path / "run.toml"
    config.write_text('[model]\ndtype = "bfloat16"\n')
    given = plan([str(fp32), "--sets", "arithmetic", "--config", str(config)])
    assert evaluate._model_settings(given, given.models[str(fp32)]).dtype == "bfloat16"


def test_a_config_with_env_shots_asks_the_sets_as_its_run_trained(tmp_path: Path) -> None:
    model = _hf_dir(tmp_path / "model", {**HF_CONFIG, "dtype": "float32"})
    config = tmp_path / "run.toml"
    config.write_text("[env]\nshots = 1\n")
    given = plan([str(model), "--sets", "arithmetic,arithmetic-reworded", "--config", str(config)])
    assert all(len(record.messages) == 3 for s in given.sets for record in s.records)  # example, reply, question
    assert all(len(record.messages) == 1 for s in plan([str(model)]).sets for record in s.records)  # no config


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--samples", "0"], "--samples 0: must be >= 1"),
        (["--samples", "4", "--temperature", "0"], "greedy decoding gives one completion"),
        (["--temperature", "-1"], "must be >= 0"),
        (["--prompts", "0"], "must be >= 1"),
        (["--max-tokens", "1024"], "--max-tokens 1024: must be < model.max_model_len = 1024"),
        (["--sets", "arithmetc"], "--sets: unknown evaluation set 'arithmetc'"),
        (["--reward-model", "/nonexistent"], "not a Hugging Face model directory"),
    ],
)
def test_bad_arguments_are_refused_before_any_engine(tmp_path: Path, args: list[str], message: str) -> None:
    model = _hf_dir(tmp_path / "m")
    with pytest.raises(EvalUsageError, match=re.escape(message)):
        plan([str(model), *args])


def test_sampling_defaults(tmp_path: Path) -> None:
    model = str(_hf_dir(tmp_path / "m"))
    greedy = plan([model, "--sets", "arithmetic"])
    assert (greedy.samples, greedy.temperature, greedy.max_tokens) == (1, 0.0, 64)
    assert greedy.reward_fn_spec == "common.tasks:arithmetic_reward" and greedy.out == Path("eval.json")
    sampled = plan([model, "--samples", "4", "--prompts", "5"])
    assert sampled.temperature == 1.0
    assert [len(s.records) for s in sampled.sets] == [5, 5, 5]


def test_cli_prints_one_line_for_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from launch.cli import main

    assert main(["eval", "tiny", "--sets", "nope"]) == 2
    assert capsys.readouterr().err.strip().startswith("tandem eval: --sets: unknown evaluation set 'nope'")


# ------------------------------------------------------------------------------ scripted completions


class ScriptedEngine:
    """The Engine interface with fixed answers: the completion of a prompt is `script(user text)`, its tokens the
    text's characters (decode joins them back); a completion of `MAX` or more characters is cut there ("length")."""

    MAX = 12

    def __init__(self, script: dict[str, str]) -> None:
        self.script, self.queued, self.shut = script, [], False

    def render(self, prompt) -> list[int]:
        return [ord(ch) for ch in prompt.messages[-1]["content"]]

    def decode(self, tokens: np.ndarray) -> str:
        return "".join(chr(int(t)) for t in tokens)

    def add(self, request_id: str, prompt_tokens: list[int], max_tokens: int | None = None) -> None:
        self.queued.append((request_id, "".join(chr(t) for t in prompt_tokens)))

    def num_unfinished(self) -> int:
        return len(self.queued)

    def step(self) -> list[FinishedSample]:
        request_id, prompt = self.queued.pop()
        text = self.script[prompt]
        tokens = np.asarray([ord(ch) for ch in text[: self.MAX]], dtype=np.int32)
        reason = "length" if len(text) >= self.MAX else "stop"
        zeros = np.zeros(len(tokens), dtype=np.float32)
        return [FinishedSample(request_id, tokens, zeros, zeros.astype(np.int32), reason, 0)]

    def shutdown(self) -> None:
        self.shut = True


def test_metrics_table_and_json_from_scripted_completions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rich.console import Console

    base, tuned = str(_hf_dir(tmp_path / "base")), str(_hf_dir(tmp_path / "tuned"))
    checked = plan([base, tuned, "--sets", "arithmetic", "--prompts", "4", "--out", str(tmp_path / "e.json")])
    records = checked.sets[0].records
    answers = {r.messages[0]["content"]: int(r.metadata["answer"]) for r in records}
    scripts = {
        base: {q: "I think it is a lot" for q in answers},  # 19 characters: cut at 12, wrong
        tuned: {q: (f"#### {a}" if i % 2 else f"= {a}") for i, (q, a) in enumerate(answers.items())},
    }
    engines: list[ScriptedEngine] = []

    def fake_engine(model_dir: Path, *args, **kwargs) -> ScriptedEngine:
        engines.append(ScriptedEngine(scripts[str(model_dir)]))
        return engines[-1]

    monkeypatch.setattr("actors.engine.offline_sampling.open_eval_engine", fake_engine)
    result = evaluate.evaluate(checked)
    assert [e.shut for e in engines] == [True, True]  # each engine shut down before the next model
    base_m, tuned_m = (result["models"][m]["sets"]["arithmetic"] for m in (base, tuned))
    assert base_m["strict_accuracy"] == 0.0 and base_m["truncated_share"] == 1.0 and base_m["mean_tokens"] == 12
    assert tuned_m["strict_accuracy"] == 0.5 and tuned_m["lenient_accuracy"] == 1.0  # 2 with the marker, 2 without
    assert tuned_m["pass@1"] == tuned_m["pass@k"] == 0.5 and tuned_m["k"] == 1
    assert tuned_m["reward/correct"] == 1.0 and tuned_m["reward/format"] == pytest.approx(0.05)
    assert tuned_m["prompts"] == 4 and tuned_m["samples"] == 4 and tuned_m["truncated_share"] == 0.0

    write_json(result, checked.out)
    written = json.loads(checked.out.read_text())
    assert written["models"][tuned]["path"] == tuned
    assert set(written["models"][tuned]["sets"]["arithmetic"]) >= {
        "strict_accuracy", "lenient_accuracy", "pass@1", "pass@k", "k", "mean_reward", "reward/correct",
        "reward/format", "mean_tokens", "truncated_share", "prompts", "samples",
    }  # fmt: skip
    console = Console(width=120, record=True)
    console.print(render_table(result))
    lines = console.export_text().splitlines()
    assert all(len(line) <= 120 for line in lines)
    rows = [line for line in lines if "0.500" in line]
    assert len(rows) == 1 and "tuned" in rows[0]  # the tuned model's row: strict 0.500


def test_reward_model_scores_join_the_figures(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actors.rewards.model import RewardModelScorer
    from tests.actors.reward_models import make_tiny_reward_model

    rm_dir = make_tiny_reward_model(tiny_model_dir, tmp_path / "rm", seed=1)
    policy = str(_hf_dir(tmp_path / "policy"))
    checked = plan([policy, "--sets", "arithmetic", "--prompts", "3", "--reward-model", str(rm_dir)])
    records = checked.sets[0].records
    script = {r.messages[0]["content"]: f"#### {r.metadata['answer']}" for r in records}
    monkeypatch.setattr("actors.engine.offline_sampling.open_eval_engine", lambda *a, **k: ScriptedEngine(script))
    figures = evaluate.evaluate(checked)["models"][policy]["sets"]["arithmetic"]
    reward = checked.config.reward
    scorer = RewardModelScorer(rm_dir, reward.dtype, reward.batch_size, checked.config.model.max_model_len, False)
    direct = [scorer.score_group(r.messages, [script[r.messages[0]["content"]]])[0] for r in records]
    # the same model, dtype and chats, scored one prompt at a time both ways: equal up to float rounding of the mean
    assert figures["rm_score"] == pytest.approx(sum(direct) / len(direct), abs=1e-6)
    assert figures["strict_accuracy"] == 1.0


# ----------------------------------------------------------------------------------------- real vLLM


@pytest.mark.vllm
def test_tandem_eval_tiny_through_vllm(tmp_path: Path) -> None:
    """`tandem eval tiny --prompts 4 --sets arithmetic` for real: vLLM starts, 4 greedy completions of the random
    tiny model are scored, the table is printed and the JSON written (the tiny model answers nonsense: the figures
    are only checked to be what 4 greedy completions can give)."""
    out = tmp_path / "eval.json"
    argv = [sys.executable, "-m", "launch.cli", "eval", "tiny", "--prompts", "4", "--sets", "arithmetic"]
    done = subprocess.run(
        [*argv, "--max-tokens", "16", "--out", str(out)], capture_output=True, text=True, timeout=400, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "arithmetic" in done.stdout and "strict" in done.stdout
    figures = json.loads(out.read_text())["models"]["tiny"]["sets"]["arithmetic"]
    assert figures["prompts"] == 4 and figures["samples"] == 4 and figures["k"] == 1
    assert 0 < figures["mean_tokens"] <= 16
    for key in ("strict_accuracy", "lenient_accuracy", "pass@1", "truncated_share"):
        assert figures[key] in (0.0, 0.25, 0.5, 0.75, 1.0), key  # a share of 4 completions
