"""On-policy distillation (learners.distillation): the advantage term and its metrics against hand-worked numbers,
the term's gradient against the analytic reverse KL, and in the trainer: the teacher's log-probs equal plain
transformers' on the teacher, and a step on the teacher term alone moves the student towards it.

Tolerances. The pure functions run in float64 (rel 1e-12: a handful of roundings of O(1) numbers). The trainer's
log-probs take the fused, chunked output layer (`learners.completion_logprobs`) where transformers takes the full
logits: the same sums in another order. log p = z - log S with S the sum of V = 49152 positive terms; torch
reduces in trees, so reordering S moves it by ~log2(V) eps_f32 = 16 eps_f32 relative, i.e. log S by 1.9e-6
absolute, and the logits (dot products of width 64) by a few eps_f32 more. atol 1e-4 is 50x that; a wrong
temperature, model or position is off by >= 1e-2.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learners.distillation import distill_advantages, distill_metrics
from learners.losses import policy_loss


def t64(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_the_teacher_term_is_added_on_action_tokens_only() -> None:
    task = t64([[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0]])
    student = t64([[-1.0, -2.0, -3.0], [-0.1, -0.2, -0.3]])
    teacher = t64([[-0.5, -2.5, -9.0], [-0.1, -1.2, -0.3]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # coef (teacher - student) = 2 x [[0.5, -0.5, (off)], [0, -1.0, 0]]
    added = distill_advantages(task, student, teacher, mask, coef=2.0, alone=False)
    assert added.flatten().tolist() == pytest.approx([1.5, -0.5, 0.0, -1.0, -3.0, -1.0], rel=1e-12)
    alone = distill_advantages(task, student, teacher, mask, coef=2.0, alone=True)
    assert alone.flatten().tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0, -2.0, 0.0], rel=1e-12)


def test_the_metrics_are_means_over_the_action_tokens() -> None:
    student = t64([[-1.0, -2.0, -3.0]])
    teacher = t64([[-0.5, -2.5, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    seen: list[np.ndarray] = []

    def sum_ranks(values: np.ndarray) -> np.ndarray:  # two ranks holding the same share: every sum doubles
        seen.append(values)
        return 2 * values

    metrics = distill_metrics(student, teacher, mask, sum_ranks)
    assert len(seen) == 1  # one collective for all three
    # d = student - teacher on the two action tokens: -0.5 and 0.5
    assert metrics["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-15)
    assert metrics["distill/teacher_logprob"] == pytest.approx(-1.5, rel=1e-12)
    assert metrics["distill/student_logprob"] == pytest.approx(-1.5, rel=1e-12)
    metrics = distill_metrics(student, t64([[-2.0, -4.0, 0.0]]), mask, sum_ranks)
    assert metrics["distill/reverse_kl"] == pytest.approx(1.5, rel=1e-12)  # (1 + 2) / 2


@pytest.mark.parametrize("behaviour", ["on_policy", "uniform"])
def test_the_policy_loss_on_the_term_descends_the_reverse_kl(behaviour: str) -> None:
    """One position with a vocabulary of V tokens, every token a row: the policy loss on the teacher term, weighted
    by how likely each token is, has the gradient of coef * KL(pi || pi_T) (exactly: a full expectation, not a
    sample). "on_policy" weights the rows by pi itself; "uniform" samples them from another policy (uniform, as a
    stale behaviour policy would) and lets the TIS weight pi / pi_behaviour do the weighting, the path η > 0 takes."""
    vocab, coef = 6, 0.7
    generator = torch.Generator().manual_seed(0)
    theta = torch.randn(vocab, generator=generator, dtype=torch.float64).requires_grad_()
    teacher_logits = torch.randn(vocab, generator=generator, dtype=torch.float64)
    logp, teacher_logp = torch.log_softmax(theta, 0), torch.log_softmax(teacher_logits, 0)
    rows = logp[:, None]  # [V, 1]: row x is the sampled token x
    mask = torch.ones(vocab, 1)
    student = rows.detach()
    advantages = distill_advantages(torch.zeros_like(student), student, teacher_logp[:, None], mask, coef, alone=True)
    if behaviour == "on_policy":  # token_mean weights rows 1 / V: weight row x by V pi(x) through the advantage
        loss, _ = policy_loss(rows, student, None, advantages * vocab * student.exp(), mask, clip_high=0.28)
    else:
        uniform = torch.full_like(student, -math.log(vocab))  # TIS weight pi(x) / (1 / V), uncapped
        loss, _ = policy_loss(rows, student, uniform, advantages, mask, correction="tis", tis_cap=1e9)
    (gradient,) = torch.autograd.grad(loss, theta)
    logp = torch.log_softmax(theta, 0)  # a fresh graph for the analytic KL
    kl = (logp.exp() * (logp - teacher_logp)).sum()
    (expected,) = torch.autograd.grad(coef * kl, theta)
    assert gradient.tolist() == pytest.approx(expected.tolist(), rel=1e-9, abs=1e-12)
    assert float(expected.abs().max()) > 1e-2  # the random logits are far apart: a real gradient is compared


# ---------------------------------------------------------------------------------------------- in the trainer
@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory: pytest.TempPathFactory):
    """Another tiny model (seed 1): the student's tokenizer, other weights."""
    from common.model_prep import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("teacher") / "tiny", seed=1)


def transformers_logprobs(model_dir, padded, temperature: float) -> torch.Tensor:
    """[B, T] log-probs of the completion tokens under softmax(logits / temperature), plain transformers."""
    from transformers import AutoModelForCausalLM

    from learners.logprobs import logprobs_from_logits

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    inputs = padded.model_inputs(slice(0, padded.size), torch.device("cpu"))
    with torch.no_grad():
        logits = model(**inputs.forward_kwargs(), logits_to_keep=inputs.num_predicted).logits[:, :-1] / temperature
        return logprobs_from_logits(logits, inputs.completion_tokens)


@pytest.mark.deepspeed
def test_the_teachers_logprobs_are_transformers_on_the_teacher(tiny_model_dir, teacher_dir, dist) -> None:
    from learners.batching import pad_groups
    from learners.trainer import Trainer
    from tests.learners.learner_fakes import learner_config, synthetic_batch

    temperature = 0.7
    config = learner_config(tiny_model_dir, algo__teacher_model=str(teacher_dir), generator__temperature=temperature)
    trainer = Trainer.from_config(config, dist)
    groups = synthetic_batch(0, 2, 4)
    padded = pad_groups(groups, [np.zeros(g.size, dtype=np.int32) for g in groups], pad_id=trainer.pad_id)
    with torch.no_grad():  # as train_step calls it
        pre = trainer._pre_update(padded, [slice(0, 3), slice(3, padded.size)])  # two micro-batches
    mask = padded.loss_mask.bool()
    expected_teacher = transformers_logprobs(teacher_dir, padded, temperature)
    expected_student = transformers_logprobs(tiny_model_dir, padded, temperature)
    # atol 1e-4 (module docstring): measured 9.5e-7 (log p ~ -10.8) on an AMD EPYC (AVX2); the
    # teacher and the student are 0.21 apart per token on average, so a mixed-up model fails by 2000x.
    assert torch.allclose(pre.teacher_logprobs[mask], expected_teacher[mask], rtol=0, atol=1e-4)
    assert torch.allclose(pre.logprobs[mask], expected_student[mask], rtol=0, atol=1e-4)
    assert float((expected_teacher - expected_student)[mask].abs().mean()) > 1e-2


@pytest.mark.deepspeed
def test_a_step_on_the_teacher_alone_moves_the_student_towards_it(tiny_model_dir, teacher_dir, dist) -> None:
    """On a fixed batch the teacher-alone loss has the gradient of (coef / 2) mean_t d_t^2 (A_t = -coef d_t, the
    ratio's gradient is grad log pi = grad d_t), so a small step lowers the mean squared per-token gap, with every
    reward equal (no task signal at all). The metrics report the gap before the step."""
    from learners.batching import pad_groups
    from learners.trainer import Trainer
    from tests.learners.learner_fakes import learner_config, synthetic_batch

    groups = synthetic_batch(0, 2, 4)
    for group in groups:
        group.rewards[:] = 1.0  # GRPO's advantages are all 0: only the teacher's term can move the weights
    staleness = [np.zeros(g.size, dtype=np.int32) for g in groups]
    config = learner_config(
        tiny_model_dir, algo__teacher_model=str(teacher_dir), algo__distill_alone=True, learner__lr=1e-3
    )
    trainer = Trainer.from_config(config, dist)
    padded = pad_groups(groups, staleness, pad_id=trainer.pad_id)
    mask = padded.loss_mask.bool()
    teacher = transformers_logprobs(teacher_dir, padded, 1.0)[mask]
    before = transformers_logprobs(tiny_model_dir, padded, 1.0)[mask]
    stats = trainer.train_step(groups, staleness)
    # abs=1e-4: a mean of per-token differences, each within the log-prob bound of the module docstring (1e-4)
    assert stats["distill/reverse_kl"] == pytest.approx(float((before - teacher).mean()), abs=1e-4)
    with torch.no_grad():
        after = trainer._pre_update(padded, [slice(0, padded.size)]).logprobs[mask]
    gap_before, gap_after = float(((before - teacher) ** 2).mean()), float(((after - teacher) ** 2).mean())
    # a 1% fall: float32 rounding moves the gap by ~1e-6 relative, so only a step that descends passes; measured
    # 0.034 -> 0.017 (AMD EPYC, AVX2); a sign error in the term raises the gap instead
    assert gap_after < 0.99 * gap_before, (gap_before, gap_after)


# ---------------------------------------------------------------------------------------------- the teacher's load
def test_a_teacher_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from learners.distillation import load_teacher

    config = LlamaConfig(
        vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=1, intermediate_size=64
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens, the policy 49152"):
        load_teacher(tmp_path / "other", tiny_model_dir, torch.float32, "sdpa")


def test_a_teacher_whose_tokenizer_maps_other_ids_is_refused(tiny_model_dir, tmp_path) -> None:
    import json
    import shutil

    from learners.distillation import load_teacher

    teacher = shutil.copytree(tiny_model_dir, tmp_path / "teacher")
    assert load_teacher(teacher, tiny_model_dir, torch.float32, "sdpa") is not None  # a copy is the same model
    tokenizer = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]  # same size, two ids swapped
    (teacher / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="maps tokens to other ids"):
        load_teacher(teacher, tiny_model_dir, torch.float32, "sdpa")


def test_distill_alone_needs_a_teacher() -> None:
    from common.config import load_config

    with pytest.raises(ValueError, match="set algo.teacher_model too"):
        load_config(None, {"algo.distill_alone": True})


def test_a_missing_teacher_is_a_config_error_before_any_role_starts(tmp_path) -> None:
    from common.config import load_config
    from launch.config_checks import missing_paths

    config = load_config(None, {"algo.teacher_model": str(tmp_path / "nowhere")})
    for role in ("run", "learner"):
        (line,) = [p for p in missing_paths(config, role) if p.startswith("algo.teacher_model")]
        assert "does not exist on this machine" in line and "leave it empty" in line
    assert not [p for p in missing_paths(config, "generator") if p.startswith("algo.teacher_model")]
    for fine in ("", "smollm2", "tiny:qwen3"):
        config = load_config(None, {"algo.teacher_model": fine})
        assert not [p for p in missing_paths(config, "learner") if p.startswith("algo.teacher_model")]


def test_distill_alone_refuses_the_no_signal_filter() -> None:
    """The filter would drop groups of equal rewards, which still carry the teacher's term."""
    from common.config import load_config

    with pytest.raises(ValueError, match='set buffer.filter = "none", or algo.distill_alone = false'):
        load_config(None, {"algo.teacher_model": "tiny", "algo.distill_alone": True, "buffer.filter": "no_signal"})
    load_config(None, {"algo.teacher_model": "tiny", "buffer.filter": "no_signal"})  # beside the reward: allowed
