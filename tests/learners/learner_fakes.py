"""Fakes beside the learner's tests: synthetic rollout groups and a fake buffer service over real sockets.

group = synthetic_group(rng, prompt_len=6, lengths=[3, 5], version=0)
buffer = FakeBuffer(port, groups_per_step=2, group_size=4, gate=2)   # real `Server` in a thread
config = process_config(model_dir, tmp_path, buffer_port, weights_port)   # for launch.testing.RoleUnderTest
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from common.config import TandemConfig, load_config
from common.sockets import Client, Server, SocketSecurity
from common.types import (
    Batch,
    BatchNotReady,
    BatchRequest,
    Ok,
    RolloutGroup,
    VersionReport,
    WeightsHeader,
    WeightsRequest,
)
from launch.testing import loopback_overrides, unpack_weights

REPO = Path(__file__).resolve().parents[2]

VOCAB = 49152


def synthetic_group(
    rng: np.random.Generator,
    prompt_len: int,
    lengths: list[int],
    version: int = 0,
    lease_id: int = 0,
    prompt_id: int = 0,
    rewards: list[float] | None = None,
    behaviour_logprob: float = -10.8,
) -> RolloutGroup:
    """A valid group of len(lengths) samples with random tokens (ids 3..VOCAB), random rewards in [0, 1)
    unless given, behaviour log-probs ~ log(1 / VOCAB) (what a near-uniform tiny model assigns)."""
    n = len(lengths)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    reward_values = np.asarray(rewards if rewards is not None else rng.random(n), dtype=np.float32)
    return RolloutGroup(
        lease_id=lease_id,
        prompt_id=prompt_id,
        epoch=0,
        generator_id=0,
        prompt_tokens=rng.integers(3, VOCAB, prompt_len).astype(np.int32),
        offsets=offsets,
        completion_tokens=rng.integers(3, VOCAB, total).astype(np.int32),
        behaviour_logprobs=np.full(total, behaviour_logprob, dtype=np.float32),
        loss_mask=np.ones(total, dtype=np.uint8),
        token_versions=np.full(total, version, dtype=np.int32),
        versions=np.full(n, version, dtype=np.int32),
        rewards=reward_values,
        finish_reasons=["length"] * n,
    )


def synthetic_batch(seed: int, num_groups: int, group_size: int, version: int = 0) -> list[RolloutGroup]:
    """`num_groups` groups of varied prompt and completion lengths, reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    return [
        synthetic_group(
            rng,
            int(rng.integers(4, 9)),
            [int(x) for x in rng.integers(2, 7, group_size)],
            version=version,
            lease_id=seed,
            prompt_id=g,
        )
        for g in range(num_groups)
    ]


class FakeBuffer:
    """The buffer's learner-facing protocol over a real `Server` in a daemon thread.

    Serves `synthetic_batch(seed=step, groups_per_step, group_size)` for each step (so any process can rebuild
    the batch of a step), split into equal contiguous shares by rank like the real buffer. Steps >= `gate`
    are answered `BatchNotReady` until `open_gate()`. Records every BatchRequest and VersionReport.
    """

    def __init__(
        self, port: int, groups_per_step: int, group_size: int, gate: int | None = None, hold_s: float = 0.2
    ) -> None:
        self.port, self.groups_per_step, self.group_size, self.gate, self.hold_s = (
            port,
            groups_per_step,
            group_size,
            gate,
            hold_s,
        )
        self.requests: list[BatchRequest] = []
        self.reports: list[VersionReport] = []
        self.learner_version = 0
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._server = Server("127.0.0.1", port, SocketSecurity(), name="fake-buffer")
        self._thread = threading.Thread(target=self._serve, daemon=True, name="fake-buffer")
        self._thread.start()

    def set_gate(self, step: int | None) -> None:
        """Answer BatchNotReady for steps >= `step` from now on (None: serve every step)."""
        with self.lock:
            self.gate = step

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                request = self._server.poll(timeout_ms=20)
                if request is not None:
                    self._server.reply(request, self._answer(request.message))
        finally:
            self._server.close()

    def _answer(self, message: object) -> object:
        with self.lock:
            if isinstance(message, VersionReport):
                self.reports.append(message)
                self.learner_version = message.step
                return Ok(learner_version=self.learner_version)
            assert isinstance(message, BatchRequest), message
            self.requests.append(message)
            if self.gate is not None and message.step >= self.gate:
                gated = True
            else:
                gated = False
        if gated:
            time.sleep(self.hold_s)  # a real buffer holds the request before answering
            return BatchNotReady(step=message.step, buffered=0)
        groups = synthetic_batch(message.step, message.num_groups, self.group_size)
        share = message.num_groups // message.world_size
        mine = groups[message.rank * share : (message.rank + 1) * share]
        staleness = [np.zeros(g.size, dtype=np.int32) for g in mine]
        return Batch(step=message.step, rank=message.rank, groups=mine, staleness=staleness, dropped_stale=3)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def learner_config(model_dir: object, **overrides: object) -> TandemConfig:
    """A small valid config for the tiny model: 2 groups of 4 per step, micro-batches of 4, fp32, lr 1e-3.
    `overrides` use dotted keys with "__" for ".": learner_config(d, learner__zero_stage=3)."""
    values: dict[str, object] = {
        "model.path": str(model_dir),
        "model.dtype": "float32",
        "algo.group_size": 4,
        "algo.max_staleness": 1,
        "learner.groups_per_step": 2,
        "learner.micro_batch_size": 4,
        "learner.lr": 1e-3,
        "learner.zero_stage": 1,
    }
    values.update({key.replace("__", "."): value for key, value in overrides.items()})
    return load_config(None, values)


def process_config(
    model_dir: object, run_root: Path, buffer_port: int, weights_port: int, **overrides: object
) -> TandemConfig:
    """`learner_config` wired to a fake buffer and a weights port on loopback, with its run dir `run_root/run`."""
    wiring = {key.replace(".", "__"): value for key, value in loopback_overrides(buffer_port, weights_port).items()}
    return learner_config(model_dir, run__root=str(run_root), run__name="run", **wiring, **overrides)


def fetch_weights(client: Client, have_version: int) -> tuple[object, dict[str, np.ndarray]]:
    """A fake generator's weight pull: (reply, name -> copied array); arrays only for a WeightsHeader."""
    reply, payload = client.request(WeightsRequest(generator_id=0, have_version=have_version), timeout_s=30)
    if not isinstance(reply, WeightsHeader):
        return reply, {}
    return reply, {spec.name: array.copy() for spec, array in unpack_weights(reply, payload)}


def safetensors_bytes(path: Path) -> dict[str, bytes]:
    """name -> raw bytes of every tensor in a safetensors file (bfloat16 stays bfloat16)."""
    import torch
    from safetensors.torch import load_file

    return {
        name: (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        for name, t in load_file(str(path)).items()
    }
