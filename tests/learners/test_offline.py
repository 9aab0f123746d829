"""The offline stages (`tandem sft|rm|dpo`, learners/offline/loop.py) on the tiny model: each trains end to end and
writes its records, checkpoint, model and summary; a resume continues at the saved step with the batches of an
uninterrupted run; micro-batches add up to one step on the whole batch; an exported reward model loads in
transformers (and in the reward service's scorer) and scores as the learner did; `tandem sft` as a process stops
on SIGINT with a checkpoint of the step it reached.

Two data-parallel ranks are not started here: they cost two more processes importing DeepSpeed (~40 s on this
machine), and the rank arithmetic is the RL learner's, whose two-rank equivalence tests/learners/test_data_parallel.py
checks; a micro-batch's loss is scaled by its share of the GLOBAL batch's units times world_size by the same
convention (learners/engine.py), and the row shares are `Schedule.share`, tested below.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import TandemConfig, load_config
from common.metrics import read_metrics
from learners.offline.loop import Schedule, run_stage

EPS_F32 = torch.finfo(torch.float32).eps


def stage_config(tmp_path: Path, name: str, **overrides: object) -> TandemConfig:
    """A small run of stage `name` on the tiny model in float32: 16 arithmetic rows, 4 held out, batches of 4,
    micro-batches of 2, lr 1e-3 (large enough that 2-3 steps move the held-out loss)."""
    values: dict[str, object] = {
        "model.path": "tiny",
        "model.dtype": "float32",
        "run.root": str(tmp_path),
        "run.name": name,
        f"{name}.num_examples": 16,
        f"{name}.num_eval_examples": 4,
        f"{name}.batch_size": 4,
        f"{name}.max_steps": 3,
        "learner.micro_batch_size": 2,
        "learner.lr": 1e-3,
    }
    values.update({key.replace("__", "."): value for key, value in overrides.items()})
    return load_config(None, values)


# ------------------------------------------------------------------------------------------------ the order
def test_the_schedule_is_a_function_of_the_step_and_covers_each_epoch_once() -> None:
    schedule = Schedule.of(num_rows=10, batch_size=4, epochs=2.0, max_steps=0, seed=7)
    assert schedule.steps == 5  # ceil(2 x 10 / 4)
    rows = [i for step in range(schedule.steps) for i in schedule.batch(step)]
    assert sorted(rows[:10]) == list(range(10)) and sorted(rows[10:20]) == list(range(10))  # each epoch whole
    assert rows[:10] != rows[10:20]  # a reshuffle per epoch
    again = Schedule.of(num_rows=10, batch_size=4, epochs=2.0, max_steps=3, seed=7)
    assert again.steps == 3 and [again.batch(s) for s in range(3)] == [schedule.batch(s) for s in range(3)]
    assert [schedule.share(2, rank, 2) for rank in (0, 1)] == [schedule.batch(2)[:2], schedule.batch(2)[2:]]
    assert Schedule.of(10, 4, 0.3, 0, 7).steps == 1  # 3 rows: one whole batch (0.3 x 10 rounds to 3, not 3.0000001)
    assert Schedule.of(10, 4, 2.0, 0, 8).batch(0) != schedule.batch(0)  # run.seed decides the order
    with pytest.raises(ValueError, match="no training rows"):
        Schedule.of(0, 4, 1.0, 0, 7)


def test_a_file_source_keeps_its_last_held_out_share_for_evaluation(tmp_path: Path) -> None:
    from learners.offline.data import chat_rows
    from learners.offline.stages import _split_file_rows

    source = tmp_path / "chats.jsonl"
    rows = [{"prompt": f"What is {i} + 1?", "completion": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(10)]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = stage_config(tmp_path, "sft", sft__source=str(source), sft__held_out=0.2, sft__num_eval_examples=1)
    train, held_out = _split_file_rows(chat_rows(str(source), config.sft), config.sft, None)
    assert [chat[0]["content"] for chat in train] == [f"What is {i} + 1?" for i in range(8)]
    assert [chat[0]["content"] for chat in held_out] == ["What is 8 + 1?"]  # rows 8 and 9, capped at 1
    given = [[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]] * 3
    train, held_out = _split_file_rows(chat_rows(str(source), config.sft), config.sft, given)
    assert len(train) == 10 and held_out == given[:1]  # eval_source: the whole source trains


# ------------------------------------------------------------------------------------------------ end to end
STAGE_KEYS = {
    "sft": ["sft/loss", "sft/tokens"],
    "rm": ["rm/loss", "rm/accuracy", "rm/margin", "rm/reward_chosen", "rm/reward_rejected"],
    "dpo": ["dpo/loss", "dpo/accuracy", "dpo/margin", "dpo/reward_chosen", "dpo/reward_rejected"],
}
COMMON_KEYS = ["policy/lr", "perf/step_s", "perf/tokens", "perf/train_tokens_per_s", "perf/samples"]


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", ["sft", "rm", "dpo"])
def test_each_stage_trains_and_writes_records_checkpoint_model_and_summary(tmp_path: Path, name: str) -> None:
    from transformers import AutoConfig

    config = stage_config(tmp_path, name, **{f"{name}__eval_every": 2})
    assert run_stage(config, name) == 0
    run_dir = config.run.run_dir
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    evaluated = {r["step"]: r for r in records if f"eval/{name}/loss" in r}
    assert sorted(evaluated) == [0, 2, 3]  # step 0, every eval_every = 2, the last
    for record in records[1:]:
        for key in STAGE_KEYS[name] + COMMON_KEYS:
            assert np.isfinite(record[key]), (record["step"], key)
    eval_keys = [f"eval/{key}" for key in STAGE_KEYS[name]]
    assert all(np.isfinite(evaluated[3][key]) for key in eval_keys)
    assert evaluated[3][f"eval/{name}/loss"] < evaluated[0][f"eval/{name}/loss"]  # it learned something
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000003"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["first_eval"]["step"] == 0 and summary["last_eval"]["step"] == 3
    assert summary["last_eval"][f"eval/{name}/loss"] == evaluated[3][f"eval/{name}/loss"]
    exported = AutoConfig.from_pretrained(run_dir / "model")
    assert exported.architectures == ["LlamaForSequenceClassification" if name == "rm" else "LlamaForCausalLM"]
    assert {"model.safetensors", "tokenizer.json", "chat_template.jinja"} <= {
        p.name for p in (run_dir / "model").iterdir()
    }
    assert not (run_dir / "model.tmp").exists()


@pytest.mark.deepspeed
def test_a_resume_continues_at_the_saved_step_with_the_batches_of_an_uninterrupted_run(tmp_path: Path) -> None:
    """2 steps, then --learner.resume true to 4, against 4 steps in one go: the same weights, bit for bit (the
    checkpoint restores float32 weights, AdamW's moments and the lr schedule exactly, and the same batches in the
    same order go through the same float32 operations), and each step recorded once."""
    from safetensors.torch import load_file

    whole = stage_config(tmp_path, "sft", run__name="whole", sft__max_steps=4)
    assert run_stage(whole, "sft") == 0
    first = stage_config(tmp_path, "sft", run__name="resumed", sft__max_steps=2)
    assert run_stage(first, "sft") == 0
    second = stage_config(tmp_path, "sft", run__name="resumed", sft__max_steps=4, learner__resume=True)
    assert run_stage(second, "sft") == 0
    records = read_metrics(second.run.run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    reference = read_metrics(whole.run.run_dir / "metrics.jsonl")
    assert [r["sft/loss"] for r in records[1:]] == [r["sft/loss"] for r in reference[1:]]
    a = load_file(whole.run.run_dir / "model" / "model.safetensors")
    b = load_file(second.run.run_dir / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((second.run.run_dir / "summary.json").read_text())
    assert summary["first_eval"]["step"] == 0 and summary["last_eval"]["step"] == 4  # the first session's eval counts


def test_a_run_dir_that_holds_a_run_is_refused_without_resume(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("RANK", raising=False)  # an in-process DeepSpeed test may have left it (a rank skips this)
    config = stage_config(tmp_path, "rm")
    config.run.run_dir.mkdir(parents=True)
    (config.run.run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    assert run_stage(config, "rm") == 2
    assert "--learner.resume true" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the update
def synthetic_examples(name: str, count: int, seed: int) -> list:
    """`count` random chats (SFT) or pairs (RM, DPO) of varied lengths: ids 3..49151, loss on each chat's last
    3-7 tokens."""
    from learners.offline.data import ChatExample, PairExample

    rng = np.random.default_rng(seed)

    def ids(n: int) -> list[int]:
        return [int(i) for i in rng.integers(3, 49152, n)]

    if name == "sft":
        chats = []
        for _ in range(count):
            prompt, reply = int(rng.integers(4, 12)), int(rng.integers(3, 8))
            chats.append(ChatExample(ids(prompt + reply), [False] * prompt + [True] * reply))
        return chats
    return [
        PairExample(ids(int(rng.integers(4, 12))), ids(int(rng.integers(2, 8))), ids(int(rng.integers(2, 8))))
        for _ in range(count)
    ]


def one_update(name: str, examples: list, **overrides: object) -> tuple[dict, dict, dict]:
    """(weights before, gradient of the global batch (captured before the optimizer steps), metrics) of one step
    of a fresh trainer on `examples`, zero_stage 0, float32."""
    from deepspeed.utils import safe_get_full_grad

    from learners.engine import init_distributed
    from learners.offline.loop import OfflineTrainer

    values = {f"{name}__batch_size": len(examples), "learner__zero_stage": 0, **overrides}
    config = stage_config(Path("/nonexistent"), name, **values)
    torch.manual_seed(config.run.seed)  # the RM's fresh head, as the loop seeds it
    trainer = OfflineTrainer(config, name, init_distributed())
    engine, gradients = trainer.engine, {}
    step = engine.step

    def capture_then_step() -> None:
        if engine.engine.is_gradient_accumulation_boundary():
            for key, param in engine.module.named_parameters():
                gradients[key] = safe_get_full_grad(param).detach().float().clone()
        step()

    engine.step = capture_then_step
    before = {key: tensor.detach().float().clone() for key, tensor in engine.full_weights()}
    stats = trainer.train_step(examples)
    return before, gradients, stats


# Micro-batches and one whole batch run the same float32 math; only the order of sums changes (the accumulation
# over micro-batches, the batch's <= ~70 token positions in every weight's gradient, matmul blocking by the
# micro-batch's row count): ~sqrt(n) eps_f32 per reduction of n <= 128 terms, a few reductions in series. The
# bound of tests/learners/test_trainer.py, which derives it: 64 eps_f32 relative to each tensor's max |g|. A
# micro-batch weighted by its own units instead of the global batch's moves the gradient by ~10-50 % (the
# micro-batches' token counts differ that much).
GRADIENT_TOLERANCE = 64 * EPS_F32


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", ["sft", "rm", "dpo"])
def test_micro_batches_of_one_row_make_the_update_of_the_whole_batch(name: str) -> None:
    examples = synthetic_examples(name, 4, seed=3)
    _, whole, whole_stats = one_update(name, examples, learner__micro_batch_size=4)
    _, split, split_stats = one_update(name, examples, learner__micro_batch_size=1)
    assert whole.keys() == split.keys() and all(float(g.abs().max()) > 0 for g in whole.values())
    for key, g in whole.items():
        error = float((split[key] - g).abs().max() / g.abs().max())
        assert error <= GRADIENT_TOLERANCE, f"{key}: {error / EPS_F32:.1f} eps_f32 x max |g|"
    loss = f"{name}/loss"
    assert split_stats[loss] == pytest.approx(whole_stats[loss], rel=GRADIENT_TOLERANCE)  # the same mean, re-summed


# ------------------------------------------------------------------------------------------------ the RM export
@pytest.mark.deepspeed
def test_an_exported_reward_model_loads_in_transformers_and_scores_as_the_learner(tmp_path: Path) -> None:
    """Trained one step, exported; the learner's scores (its engine, in eval mode) against transformers'
    AutoModelForSequenceClassification on the export, batched and one by one, and the reward service's scorer.

    Tolerance: the same float32 weights (the export is exact) through the same operations; only the batch's
    padding width and row count change the order of float32 sums (hidden 64, MLP 128, <= 30 positions), a few
    eps_f32 of each score's scale per reduction: 64 eps_f32 x max(1, max |score|). A head or a pooling that is
    not the learner's (a fresh head, the score read at a pad position) moves scores by ~0.1."""
    from transformers import AutoModelForSequenceClassification

    from actors.rewards.model import RewardModelScorer
    from learners.engine import init_distributed
    from learners.offline.loop import OfflineTrainer
    from learners.offline.stages import _pair_sequences

    config = stage_config(tmp_path, "rm", rm__batch_size=4, learner__zero_stage=0)
    torch.manual_seed(config.run.seed)
    trainer = OfflineTrainer(config, "rm", init_distributed())
    trainer.train_step(synthetic_examples("rm", 4, seed=5))
    pairs = synthetic_examples("rm", 6, seed=6)
    stage = trainer.stage
    trainer.engine.train(False)
    with torch.no_grad():
        learner_scores = stage.scores(trainer.engine, _pair_sequences(pairs, stage.pad_id, torch.device("cpu")))
    model_dir = tmp_path / "model"
    trainer.export_final(model_dir)

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id == stage.pad_id
    rows = [[*p.prompt_ids, *p.chosen_ids] for p in pairs] + [[*p.prompt_ids, *p.rejected_ids] for p in pairs]
    tolerance = 64 * EPS_F32 * max(1.0, float(learner_scores.abs().max()))
    with torch.no_grad():
        one_by_one = torch.tensor([float(model(input_ids=torch.tensor([row])).logits[0, 0]) for row in rows])
        batch = _pair_sequences(pairs, stage.pad_id, torch.device("cpu"))
        batched = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()).logits[:, 0]
    assert float(learner_scores.std()) > 1e-3  # the scores differ between rows: a real comparison
    assert torch.allclose(one_by_one, learner_scores, rtol=0, atol=tolerance)
    assert torch.allclose(batched, learner_scores, rtol=0, atol=tolerance)
    scorer = RewardModelScorer(model_dir, dtype="float32", batch_size=4, max_len=2048, normalize=False)
    served = torch.tensor(scorer.raw_scores(rows))
    assert torch.allclose(served, learner_scores, rtol=0, atol=tolerance)


# ------------------------------------------------------------------------------------------------ the command
@pytest.mark.integration
def test_tandem_sft_stops_on_sigint_with_a_checkpoint_and_resumes_there(tmp_path: Path) -> None:
    """`tandem sft` as a process (the CLI entry, the path checks, the signal handling): SIGINT once step 1 is
    recorded; it exits 130 with the checkpoint of the step it reached; resumed in this process, it continues at
    that step and records each step once."""
    from launch.testing import RoleUnderTest

    config = stage_config(tmp_path, "sft", sft__max_steps=1000, sft__epochs=100, sft__num_examples=64)
    metrics = config.run.run_dir / "metrics.jsonl"
    with RoleUnderTest(config, "sft") as role:
        role.wait_until(lambda: metrics.is_file() and len(read_metrics(metrics)) >= 2, 120, "step 1's record")
        role.send_signal(signal.SIGINT)
        assert role.wait(60) == 130, role.tail()
    (saved,) = [p.name for p in (config.run.run_dir / "checkpoints").iterdir()]
    step = int(saved.removeprefix("step-"))
    assert f"SIGINT at step {step}/1000: checkpoint" in role.output()
    resumed = stage_config(
        tmp_path, "sft", sft__max_steps=step + 1, sft__epochs=100, sft__num_examples=64, learner__resume=True
    )
    assert run_stage(resumed, "sft") == 0
    assert [r["step"] for r in read_metrics(metrics)] == list(range(step + 2))
