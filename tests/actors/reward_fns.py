"""Reward functions the generator tests name in their configs (`tests.actors.reward_fns:...`)."""

from __future__ import annotations

from typing import Any


def explode_or_length(completion: str, metadata: dict[str, Any]) -> dict[str, float]:
    """Raises for prompts marked `explode` (the generator must survive it); else rewards the completion's length."""
    if metadata.get("explode"):
        raise RuntimeError("reward exploded on purpose")
    return {"length": len(completion) / 100.0, "nonempty": float(bool(completion))}
