"""A tiny reward model for the reward tests: the `tiny` policy's architecture with a fresh one-label head."""

from __future__ import annotations

from pathlib import Path


def make_tiny_reward_model(policy_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """An AutoModelForSequenceClassification (num_labels = 1) from the config of the tiny policy in `policy_dir`,
    random weights from `seed` (torch's global RNG untouched), saved with the policy's tokenizer in `out_dir`:
    the shape of what `tandem rm` exports."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(policy_dir)
    config.num_labels = 1
    config.architectures = None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(policy_dir).save_pretrained(out_dir)
    return out_dir
