"""On-policy distillation: a frozen teacher scores the student's own samples token by token, and the reverse KL to
it becomes a per-token advantage (algo.teacher_model, algo.distill_coef, algo.distill_alone).

    teacher = load_teacher(teacher_dir, student_dir, dtype, attention)  # frozen, eval mode, the student's vocabulary
    advantages = distill_advantages(task, student, teacher_lp, mask, coef, alone)                   # [B, T]
    metrics = distill_metrics(student, teacher_lp, mask, sum_ranks)                                  # a collective

The term. For tokens x_t sampled from the student pi, the per-token reverse KL to the teacher pi_T is estimated by
d_t = log pi(x_t | x_<t) - log pi_T(x_t | x_<t), and its score-function gradient is E_pi[d_t grad log pi(x_t)]
(the term E_pi[grad log pi] is 0). So the advantage

    A_t = A_task_t - coef * d_t          (alone: A_t = -coef * d_t)           on action tokens, 0 elsewhere

fed to the policy loss the task advantages go through (`learners.losses.policy_loss`, -A_t * ratio) descends
coef * KL(pi || pi_T) token by token: tokens the teacher finds likelier than the student are pushed up, the others
down. Per token, with no reward-to-go over later tokens (discount 0, as in Thinking Machines' on-policy
distillation, Lu 2025): the effect of x_t on the later tokens' KL is left out, which lowers the variance and biases
the sequence-level gradient. Reverse KL seeks the teacher's modes, so the student's entropy falls (measured in
benchmarks/distillation: 1.84 -> 0.56 nats over 12 steps). The task advantages (the estimator's, normalised per group) are added unchanged; the
teacher term is not normalised, so coef sets its scale against them.

log pi is the proximal policy's (the weights before this batch's update: the trainer's no-grad pass, which the
teacher turns on), not the behaviour log-probs vLLM returned: the KL is the one of the weights being trained, and
the vLLM-trainer mismatch stays out of the reward. Both log-probs are of softmax(logits / temperature), the
generator's sampling temperature, as every log-prob the learner takes.

Staleness (algo.max_staleness > 0): the teacher scores exactly the tokens that were sampled, whichever version
sampled them (it is frozen, so its scores do not go stale); the student's side is the proximal policy's. The samples
came from pi_behaviour, up to η versions old, and the correction the task reward uses (algo.correction: the weight
pi_prox / pi_behaviour, truncated or masked) reweights them to pi_prox's distribution. Staleness therefore enters the
distillation term exactly as it enters the task term, through that one importance weight.

The teacher must share the student's tokenizer: its vocabulary size, and its token -> id map when both directories
hold a tokenizer, are checked at load (ValueError saying what differs). It is a full frozen replica on every rank,
like the reference model (`learners.models.load_reference`): its weights in the training dtype, no optimizer state.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from learners.rollout_stats import Reduce


def load_teacher(teacher_dir: Path, student_dir: Path, dtype: torch.dtype, attention: str) -> nn.Module:
    """The frozen teacher (eval mode, no gradients) from a Hugging Face directory. Raises ValueError when its
    vocabulary is not the one of the student in `student_dir`."""
    from transformers import AutoConfig

    from learners.models import load_reference

    teacher = load_reference(teacher_dir, dtype, attention)
    student_vocab = int(AutoConfig.from_pretrained(str(student_dir), local_files_only=True).vocab_size)
    if int(teacher.config.vocab_size) != student_vocab:
        raise ValueError(
            f"algo.teacher_model: {teacher_dir} has a vocabulary of {teacher.config.vocab_size} tokens, the policy "
            f"{student_vocab}; the teacher scores the student's token ids, so it needs the student's tokenizer "
            "(distil from a model of the same family, or fine-tune the teacher from the student)"
        )
    _check_same_tokens(teacher_dir, student_dir)
    return teacher


def _check_same_tokens(teacher_dir: Path, student_dir: Path) -> None:
    """ValueError when both directories hold a tokenizer and their token -> id maps differ."""
    from transformers import AutoTokenizer

    if not ((teacher_dir / "tokenizer_config.json").is_file() and (student_dir / "tokenizer_config.json").is_file()):
        return
    teacher = AutoTokenizer.from_pretrained(str(teacher_dir), local_files_only=True).get_vocab()
    student = AutoTokenizer.from_pretrained(str(student_dir), local_files_only=True).get_vocab()
    if teacher != student:
        differ = sorted(set(teacher.items()) ^ set(student.items()))[:3]
        raise ValueError(
            f"algo.teacher_model: {teacher_dir}'s tokenizer maps tokens to other ids than the policy's "
            f"({student_dir}), e.g. {differ}; the teacher must share the student's tokenizer"
        )


def distill_advantages(
    task: torch.Tensor,
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    alone: bool,
) -> torch.Tensor:
    """[B, T]: `task` (the estimator's advantages) + coef * (teacher - student) on the action tokens (`mask`), or
    the teacher term alone with `alone`; 0 off the action tokens. `student`, `teacher`: log-probs [B, T] of the
    sampled tokens under the proximal policy and the teacher."""
    term = torch.where(mask.bool(), coef * (teacher - student), torch.zeros_like(student))  # -coef * d_t
    return term if alone else task + term


def distill_metrics(
    student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, sum_ranks: Reduce
) -> dict[str, float]:
    """Means over the global batch's action tokens (a collective): `distill/reverse_kl`, the mean of d_t = log pi -
    log pi_T (the per-token reverse KL on the student's samples: it falls as the student nears the teacher),
    `distill/teacher_logprob` and `distill/student_logprob`."""
    m = mask.bool()
    local = np.array(
        [
            float(m.sum()),
            float((student - teacher)[m].double().sum()),
            float(teacher[m].double().sum()),
            float(student[m].double().sum()),
        ]
    )
    tokens, kl, teacher_sum, student_sum = sum_ranks(local)
    tokens = max(tokens, 1.0)
    return {
        "distill/reverse_kl": float(kl / tokens),
        "distill/teacher_logprob": float(teacher_sum / tokens),
        "distill/student_logprob": float(student_sum / tokens),
    }
