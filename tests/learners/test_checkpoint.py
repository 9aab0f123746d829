"""Checkpoints: crash safety (.tmp never loads), retention, RNG round trip, and a resumed trainer taking exactly
the step an uninterrupted one takes (policy, critic, optimizer and scheduler state all restored)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from learners.checkpoint import CheckpointManager, LearnerState, capture_rng, latest_step, restore_rng, trim_records


class FakeTrainer:
    """Writes a marker file; `fail` makes save_state raise halfway (a crash mid-save)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.loaded: Path | None = None

    def save_state(self, directory: Path) -> None:
        (directory / "weights.bin").write_bytes(b"w")
        if self.fail:
            raise RuntimeError("killed mid-save")

    def load_state(self, directory: Path) -> None:
        self.loaded = directory


def test_a_crash_mid_save_leaves_the_previous_checkpoint_as_latest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, rank=0)
    first = manager.save(FakeTrainer(), LearnerState(step=2, policy_version=2))
    with pytest.raises(RuntimeError, match="killed mid-save"):
        manager.save(FakeTrainer(fail=True), LearnerState(step=4, policy_version=4))
    assert (tmp_path / "step-000004.tmp").is_dir()
    assert manager.latest() == first
    restarted = CheckpointManager(tmp_path, rank=0)  # a restarted learner removes the leftover
    assert not (tmp_path / "step-000004.tmp").exists()
    trainer = FakeTrainer()
    state = restarted.load(restarted.latest(), trainer)
    assert (state.step, state.policy_version) == (2, 2) and trainer.loaded == first


def test_a_directory_without_learner_state_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "step-000009").mkdir(parents=True)  # e.g. copied by hand, incomplete
    manager = CheckpointManager(tmp_path, rank=0)
    assert manager.latest() is None
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        manager.load(tmp_path / "step-000009", FakeTrainer())


def test_latest_step_reads_only_complete_checkpoints(tmp_path: Path) -> None:
    assert latest_step(tmp_path / "none") is None
    manager = CheckpointManager(tmp_path, rank=0)
    manager.save(FakeTrainer(), LearnerState(step=3, policy_version=3))
    (tmp_path / "step-000007.tmp").mkdir()  # a save in progress (or a crash's leftover): left alone, not counted
    (tmp_path / "step-000009").mkdir()
    assert latest_step(tmp_path) == 3 and (tmp_path / "step-000007.tmp").is_dir()


def test_a_resume_drops_the_records_of_later_steps(tmp_path: Path) -> None:
    """metrics.jsonl of a learner killed after step 3 with checkpoint 2, its last line torn mid-write: resumed at
    step 2, the file holds steps 1 and 2 only, so steps 3.. are recorded once, by the resumed learner."""
    path = tmp_path / "metrics.jsonl"
    assert trim_records(path, 2) == 0  # no file yet: nothing to do
    path.write_text(
        "".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "rew'
    )
    assert trim_records(path, 2) == 2
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert path.read_text().endswith("\n") and trim_records(path, 2) == 0
    assert trim_records(path, 0) == 2 and path.read_text() == ""  # resumed with no checkpoint: step 0


def test_only_the_newest_checkpoints_are_kept(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, rank=0, keep=2)
    for step in (1, 2, 3, 10):
        manager.save(FakeTrainer(), LearnerState(step=step, policy_version=step, samples_trained=8 * step))
    assert [p.name for p in manager.complete()] == ["step-000003", "step-000010"]
    saved = json.loads((tmp_path / "step-000010" / "learner_state.json").read_text())
    assert saved == {"step": 10, "policy_version": 10, "samples_trained": 80, "tokens_trained": 0, "groups_trained": 0}


def test_rng_states_round_trip() -> None:
    state = capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    restore_rng(json.loads(json.dumps(state)))
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])


@pytest.mark.deepspeed
def test_resumed_trainer_takes_the_same_step_as_an_uninterrupted_one(tiny_model_dir, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from learners.engine import init_distributed
    from learners.trainer import Trainer
    from tests.learners.learner_fakes import learner_config, synthetic_batch

    dist = init_distributed()
    config = learner_config(tiny_model_dir, algo__estimator="gae", algo__kl_coef=0.05, learner__warmup_steps=3)
    batches = [synthetic_batch(seed, 2, 4) for seed in (1, 2)]
    stale = [np.zeros(4, dtype=np.int32)] * 2
    manager = CheckpointManager(tmp_path, rank=0)

    trainer = Trainer.from_config(config, dist)
    trainer.train_step(batches[0], stale)
    path = manager.save(trainer, LearnerState(step=1, policy_version=1))
    exported = AutoModelForCausalLM.from_pretrained(path / "hf", dtype=torch.float32).state_dict()
    for name, tensor in trainer.full_weights():
        assert torch.equal(exported[name], tensor), name
    uninterrupted = trainer.train_step(batches[1], stale)
    expected = {name: t.clone() for name, t in trainer.full_weights()}
    expected_critic = trainer.critic.module.value_head.weight.detach().clone()

    resumed = Trainer.from_config(config, dist)
    state = manager.load(manager.latest(), resumed)
    assert state.step == 1
    stats = resumed.train_step(batches[1], stale)
    # Exact, not within a tolerance: both steps run in this process, on the same weights, optimizer state and
    # batch, with the same shapes and thread count, so the CPU kernels (GEMMs, static-partition reductions) repeat
    # their arithmetic bit for bit on any CPU. A tolerance for a reordered computation would have to be ~lr (AdamW
    # moves weights with |g| ~ eps_adam by up to lr on a last-bit change in g): the size of what this test must
    # catch, a moment estimate, step count or lr schedule not restored.
    assert stats["policy/lr"] == uninterrupted["policy/lr"]  # the warm-up schedule continued
    assert stats["loss/value"] == uninterrupted["loss/value"]
    for name, tensor in resumed.full_weights():
        assert torch.equal(tensor, expected[name]), name
    assert torch.equal(resumed.critic.module.value_head.weight.detach(), expected_critic)
