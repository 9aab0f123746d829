"""examples/minimal_grpo.py: its pieces against direct computations on the tiny model, and its loop end to end."""

from __future__ import annotations

import math

import torch

from examples import minimal_grpo
from learners.logprobs import logprobs_from_logits


def tiny() -> tuple[object, object]:
    torch.manual_seed(0)
    return minimal_grpo.load("tiny")


def test_the_action_mask_ends_at_the_first_end_of_sequence_token() -> None:
    model, tokenizer = tiny()
    torch.manual_seed(1)
    batch = minimal_grpo.generate(model, tokenizer, [[1, 2, 3], [4, 5]], n=3, max_tokens=12, greedy=False)
    eos = tokenizer.eos_token_id
    assert batch["completions"].shape[0] == 6 and batch["prompt_ids"].shape == (6, 3)
    for row, mask in zip(batch["completions"].tolist(), batch["action_mask"].tolist(), strict=True):
        first = row.index(eos) if eos in row else len(row)
        assert mask == [True] * min(first + 1, len(row)) + [False] * (len(row) - first - 1)


def test_log_probs_of_left_padded_prompts_equal_each_sequence_alone() -> None:
    """Left padding shifts positions: the batch's log-probs must be those of each prompt + completion unpadded."""
    model, tokenizer = tiny()
    torch.manual_seed(2)
    prompts = [[7, 8, 9, 10, 11], [12, 13]]
    batch = minimal_grpo.generate(model, tokenizer, prompts, n=2, max_tokens=6, greedy=False)
    with torch.no_grad():
        batched = minimal_grpo.completion_logprobs(model, batch)  # [4, T]
        for i in range(4):
            prompt = prompts[i // 2]
            kept = int(batch["action_mask"][i].sum())
            tokens = torch.tensor([prompt + batch["completions"][i, :kept].tolist()])
            alone = logprobs_from_logits(
                model(input_ids=tokens).logits[:, len(prompt) - 1 : -1], tokens[:, len(prompt) :]
            )
            # float32 forwards of the same sequence with and without padding: the attention sums differ only in
            # the order of additions, ~1e-6 relative on these magnitudes; 1e-4 leaves room and still catches a
            # shifted position (differences of order 1)
            torch.testing.assert_close(batched[i, :kept], alone[0], rtol=0, atol=1e-4)


def test_a_step_raises_the_log_probs_of_what_was_rewarded_over_what_was_not() -> None:
    """One step of the loop with a reward the tiny random model can earn: the share of even token ids in a
    completion (about half of any sample, different between samples, so every group has a spread). Afterwards the
    completions that scored above their group's mean must have gained log-probability relative to those below it:
    GRPO's advantages and the clipped loss pushed the right way (a sign error anywhere reverses the order). At lr
    1e-3 the two means move by +0.50 and -0.51 nats (measured, AMD EPYC AVX-512): the 0.1 margin is a tenth of that
    gap, and float32 rounding of a forward on 4 tokens (~1e-5) is four orders under it, on any CPU."""
    model, tokenizer = tiny()
    seen = {}

    def even_share(tokenizer, batch, records, n) -> torch.Tensor:
        mask = batch["action_mask"]
        rewards = ((batch["completions"] % 2 == 0) & mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        with torch.no_grad():
            seen.update(batch=batch, rewards=rewards, before=minimal_grpo.completion_logprobs(model, batch))
        return rewards

    args = minimal_grpo.parse_args(
        [
            "--steps",
            "1",
            "--prompts-per-step",
            "2",
            "--group-size",
            "8",
            "--max-tokens",
            "4",
            "--eval-prompts",
            "1",
            "--lr",
            "1e-3",
            "--ppo-epochs",
            "1",
        ]
    )
    torch.manual_seed(3)
    minimal_grpo.train(model, tokenizer, args, score_fn=even_share)
    with torch.no_grad():
        after = minimal_grpo.completion_logprobs(model, seen["batch"])
    mask = seen["batch"]["action_mask"]
    gained = ((after - seen["before"]) * mask).sum(dim=1)  # [B]  log-prob gained by each completion
    group_mean = seen["rewards"].view(2, 8).mean(dim=1).repeat_interleave(8)
    above, below = seen["rewards"] > group_mean, seen["rewards"] < group_mean
    assert above.any() and below.any()
    assert gained[above].mean() > gained[below].mean() + 0.1, (gained[above], gained[below])


def test_the_loop_trains_and_evaluates(capsys) -> None:
    history = minimal_grpo.main(
        [
            "--model",
            "tiny",
            "--steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "3",
            "--max-tokens",
            "6",
            "--eval-prompts",
            "2",
            "--ppo-epochs",
            "2",
        ]
    )
    assert [row["step"] for row in history["steps"]] == [1, 2]
    assert all(math.isfinite(row["loss"]) and 0 < row["completion_tokens"] <= 6 for row in history["steps"])
    assert 0.0 <= history["accuracy_before"] <= 1.0 and 0.0 <= history["accuracy_after"] <= 1.0
    assert "held-out greedy strict accuracy after 2 steps" in capsys.readouterr().out
