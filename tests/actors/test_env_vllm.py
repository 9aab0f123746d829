"""`tandem generator` with real vLLM (tiny model) and a two-turn environment: trajectories are token-exact.

The generator runs as its own process against a fake buffer; the environment is tests.actors.env_fakes:TwoTurnEnv
(turn 1 is answered "Are you sure? Check again.", turn 2 ends the episode). The model's final norm is scaled up
(SHARPEN) so that its distributions are peaked: a token scored one position off misses by nats (checked too).
Checked on every sample:
  * environment tokens are exactly the chat-template delta of the observation after the model's sampled turn;
  * each model token's behaviour log-prob (vLLM, bf16) matches a float32 transformers forward pass over the whole
    trajectory, prompt + turn 1 + environment tokens + turn 2 (within BF16_ROUNDINGS, below);
  * the second turn got its own max_tokens: the episode's remaining budget (env.max_total_tokens).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from launch.testing import FakeBuffer, FakePublisher, RoleUnderTest, arithmetic_items, run_config

pytestmark = pytest.mark.vllm

GROUP_SIZE = 3
TURN_TOKENS = 8
TEMPERATURE = 0.7
SHARPEN = 6.0  # peaked enough that a misplaced token misses by nats, not so peaked that every log-prob is 0
# vLLM runs the bf16 weights in bf16, the reference runs them in float32. bf16 keeps 8 significant bits, so each
# rounding on the way to the logits moves them by <= 2^-8 of their scale, max |z / T| (~10 here), and
# d log p_t / dz_i = [i = t] - p_i turns a logit error dz into |d log p_t| <= 2 max |dz|. A few roundings reach the
# logits in series (the last layer's output, the final norm, lm_head; earlier ones are damped by the residual
# stream): transformers' own bf16 forward is off by 1.4 of them. Allowed: 4 roundings on every token, 2 x 4 x 2^-8
# max |z / T| (~0.3), and one (2^-8 of the median scale, ~0.04) on the median token. Measured on an Intel Xeon: max
# 0.023, median 0.006. One position off misses by nats (median 7.6, checked below); a wrong temperature or stale
# weights move every token, the median with them.
BF16_ROUNDINGS = 4
OBSERVATION = [{"role": "user", "content": "Are you sure? Check again."}]


def sharpened_model(tiny_model_dir: Path, out: Path) -> Path:
    """A copy of the tiny model with its final norm scaled by SHARPEN (bf16, like the original)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model_dir, out)
    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    tensors["model.norm.weight"] = (tensors["model.norm.weight"].float() * SHARPEN).to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_two_turn_episodes_with_vllm_are_token_exact(tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.environments.chat_turns import ChatTurnRenderer

    model_dir = sharpened_model(tiny_model_dir, tmp_path / "sharp")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    renderer = ChatTurnRenderer(tokenizer)
    env_length = len(renderer.render_turn(np.array([5]), OBSERVATION))  # a turn that did not end on <|im_end|>
    budget = TURN_TOKENS + env_length + 5  # turn 2 gets 5 tokens of room when turn 1 used all 8
    config = run_config(
        tmp_path / "runs",
        "gen",
        model={"path": str(model_dir), "max_model_len": 512},
        algo={"group_size": GROUP_SIZE},
        env={"environment": "tests.actors.env_fakes:TwoTurnEnv", "max_total_tokens": budget, "max_turns": 4},
        generator={
            "max_tokens": TURN_TOKENS,
            "temperature": TEMPERATURE,
            "prompts_in_flight": 3,
            "reconnect_max_s": 0.5,
        },
    )
    with (
        FakeBuffer(config, arithmetic_items(3), lease_size=3) as buffer,
        FakePublisher(config.learner.weights_port),
        RoleUnderTest(config, "generator") as generator,
    ):
        code, err = generator.wait(300), generator.output()
    assert code == 0, err[-3000:]
    groups = list(buffer.groups.values())
    assert len(groups) == 3

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    errors, scales, shifted_errors, behaviour, second_turns = [], [], [], [], []
    for group in groups:
        group.validate()
        assert group.finish_reasons and all(r in ("done", "length") for r in group.finish_reasons)
        for i in range(group.size):
            span = slice(int(group.offsets[i]), int(group.offsets[i + 1]))
            tokens, mask = group.completion_tokens[span], group.loss_mask[span]
            first_len = int(np.argmin(mask))  # model turn 1, then environment tokens, then model turn 2
            env_len = int(np.argmax(mask[first_len:]))
            turn1, env_tokens, turn2 = np.split(tokens, [first_len, first_len + env_len])
            assert mask[first_len + env_len :].all() and 1 <= len(turn1) <= TURN_TOKENS
            assert env_tokens.tolist() == renderer.render_turn(turn1, OBSERVATION)
            room = min(TURN_TOKENS, budget - first_len - env_len)
            ended = turn2[-1] == renderer.end_of_turn_id()
            assert len(turn2) == room or (ended and len(turn2) < room), (len(turn2), room)
            second_turns.append((len(turn2), room))
            sequence = torch.from_numpy(np.concatenate([group.prompt_tokens, tokens]).astype(np.int64))[None]
            with torch.no_grad():
                logits = reference(sequence).logits[0, len(group.prompt_tokens) - 1 : -1].float() / TEMPERATURE
            logprobs = torch.log_softmax(logits, -1)
            expected = logprobs.gather(1, torch.from_numpy(tokens.astype(np.int64))[:, None])[:, 0].numpy()
            errors.append(np.abs(expected - group.behaviour_logprobs[span])[mask == 1])
            scales.append(logits.abs().amax(-1).numpy()[mask == 1])  # max |z / T| at each model token
            behaviour.append(group.behaviour_logprobs[span][mask == 1])
            shifted = logprobs[1:].gather(1, torch.from_numpy(tokens[:-1].astype(np.int64))[:, None])[:, 0].numpy()
            shifted_errors.append(np.abs(shifted - group.behaviour_logprobs[span][:-1])[mask[:-1] == 1])
    errors, scales, shifted_errors, behaviour = map(np.concatenate, (errors, scales, shifted_errors, behaviour))
    print(
        f"log-prob |error| median {np.median(errors):.4f} max {errors.max():.4f} (one position off: median "
        f"{np.median(shifted_errors):.2f}); behaviour log-prob median {np.median(behaviour):.2f}; "
        f"turn-2 (length, room) {second_turns}"
    )
    assert np.all(errors <= 2 * BF16_ROUNDINGS * 2**-8 * scales), (errors / (2**-7 * scales)).max()
    assert np.median(errors) <= 2**-8 * np.median(scales)
    assert np.median(behaviour) < -0.1 and np.median(shifted_errors) > 1.0  # the comparison can tell positions apart
    assert any(length == room < TURN_TOKENS for length, room in second_turns)  # the budget, not max_tokens, cut it
