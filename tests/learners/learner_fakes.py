"""Fakes beside the learner's tests: synthetic rollout groups and a buffer fed with them over real sockets.

group = synthetic_group(rng, prompt_len=6, lengths=[3, 5], version=0)
buffer = SyntheticBuffer(port, groups_per_step=2, group_size=4, gate=2)   # the real BufferCore, fed these
config = process_config(model_dir, tmp_path)   # free loopback ports; for launch.testing.RoleUnderTest
buffer = run_learner_to_end(config, groups_per_step=2, group_size=4)   # the learner role run to its end
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from buffers.core import BufferCore, RequestRejected
from buffers.state import BufferSettings, BufferState
from common.config import TandemConfig, load_config
from common.sockets import Client, Server
from common.types import BatchRequest, LeaseGrant, LeaseRequest, RolloutGroup, VersionReport
from common.weight_messages import WeightsHeader, WeightsRequest
from launch.testing import RoleUnderTest, ServerThread, free_port, loopback_overrides, unpack_weights
from tests.buffers.fakes import fake_prompts

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


class SyntheticBuffer(ServerThread):
    """The buffer as learners see it: the real `BufferCore`, fed `synthetic_batch(step, num_groups, group_size)`
    as generators would feed it (leased, pushed, acked), so any process can rebuild the batch of a step.

    The groups of step s are stamped with version s (staleness 0 when drawn at step s) and fed when a rank first
    asks for step s, unless s >= `gate` (`set_gate`): the core then holds the request and answers BatchNotReady at
    its timeout, as a buffer without enough groups does (`set_gate(..., serve_held=True)`: a request held for a step
    the gate now opens is answered at once, its groups fed then, as a buffer serves a held request once enough
    groups arrive, instead of at its timeout, the learner's hold_s of 5 s). With `stale_at` = s, one extra group of
    version 0 goes in first at step s: the core drops it as too stale (η = MAX_STALENESS), so `Batch.dropped_stale`
    counts its samples from then on. With `flat_at` = s the core filters (buffer.filter = "no_signal") and one extra
    group of rewards all 1.0 goes in at step s: it is filtered at arrival, so `Batch.dropped_no_signal` counts its
    samples and `Batch.no_signal_reward_sum` their rewards (group_size x 1.0) from then on (the synthetic groups'
    random rewards always have a spread: they are kept). Everything else (shares by rank, held requests, the step a VersionReport
    allows, the rejections) is the core's. Records every BatchRequest and VersionReport. Started on construction.
    """

    name = "fake-buffer"
    MAX_STALENESS = 2

    def __init__(
        self,
        port: int,
        groups_per_step: int,
        group_size: int,
        gate: int | None = None,
        stale_at: int | None = None,
        flat_at: int | None = None,
    ) -> None:
        super().__init__(port)
        settings = BufferSettings(
            capacity=1 << 16,
            max_reuse=1,
            sampling="fifo",
            lease_timeout_s=300.0,
            heartbeat_timeout_s=300.0,
            epochs=0,
            group_size=group_size,
            max_staleness=self.MAX_STALENESS,
            groups_per_step=groups_per_step,
            sync_every=1,
            seed=0,
            filter="none" if flat_at is None else "no_signal",
        )
        self.core = BufferCore(BufferState(settings, fake_prompts(1 << 12), journal=None))
        self.group_size, self.gate, self.stale_at, self.flat_at = group_size, gate, stale_at, flat_at
        self.fed: set[int] = set()  # steps whose groups are in the core
        self.gated: dict[int, int] = {}  # step -> num_groups of a held request the gate kept from being fed
        self.serve_held = False
        self.requests: list[BatchRequest] = []
        self.reports: list[VersionReport] = []
        self.start()

    def set_gate(self, step: int | None, serve_held: bool = False) -> None:
        """Feed no groups for steps >= `step` from now on (None: feed every step). `serve_held`: feed the steps
        this opens that a held request asks for now (else that request is answered BatchNotReady at its timeout)."""
        with self.lock:
            self.gate, self.serve_held = step, serve_held
            if not serve_held:
                self.gated.clear()

    def answer(self, server: Server, request: Any) -> list[tuple[Any, Any, list[Any]]]:
        message, replies = request.message, []
        if isinstance(message, BatchRequest):
            self.requests.append(message)
            if self.gate is None or message.step < self.gate:
                replies = self._feed(message.step, message.num_groups)
            else:
                self.gated[message.step] = message.num_groups
        elif isinstance(message, VersionReport):
            self.reports.append(message)
        try:
            replies += self.core.handle(message, request, request.sender, time.time())
        except RequestRejected as refusal:
            server.reject(request, refusal.reason, refusal.kind)
        return [(reply_to, reply, []) for reply_to, reply in replies]

    def housekeeping(self) -> list[tuple[Any, Any, list[Any]]]:
        replies = []
        if self.serve_held:
            for step in [s for s in self.gated if self.gate is None or s < self.gate]:
                replies += self._feed(step, self.gated.pop(step))  # answers the request the core holds for it
        replies += self.core.tick(time.time())
        return [(reply_to, reply, []) for reply_to, reply in replies]

    def _feed(self, step: int, num_groups: int) -> list[tuple[Any, Any]]:
        """Lease and push the groups of `step` (once); the replies that pushing made due to held requests."""
        if step in self.fed:
            return []
        self.fed.add(step)
        groups = synthetic_batch(step, num_groups, self.group_size, version=step)
        if step == self.stale_at:
            groups.insert(0, synthetic_batch(1_000_000 + step, 1, self.group_size, version=0)[0])  # another seed
        if step == self.flat_at:
            flat = synthetic_batch(2_000_000 + step, 1, self.group_size, version=step)[0]
            groups.insert(0, dataclasses.replace(flat, rewards=np.ones(self.group_size, np.float32)))
        now = time.time()
        ((_, grant),) = self.core.handle(LeaseRequest(0, len(groups), step), None, "fake-generator", now)
        if not isinstance(grant, LeaseGrant) or len(grant.prompts) != len(groups):
            raise RuntimeError(f"the core would not lease {len(groups)} prompts for step {step}: {grant}")
        due = []
        for group, prompt in zip(groups, grant.prompts):
            group = dataclasses.replace(group, lease_id=grant.lease_id, prompt_id=prompt.prompt_id, epoch=prompt.epoch)
            (_, ack), *served = self.core.handle(group, None, "fake-generator", now)
            if ack.status != "accepted":
                raise RuntimeError(f"the core did not accept a synthetic group of step {step}: {ack}")
            due += served
        return due

    def close(self) -> None:
        self.stop()


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


def process_config(model_dir: object, run_root: Path, **overrides: object) -> TandemConfig:
    """`learner_config` with its run dir `run_root/run`, the buffer and the weights on free loopback ports (read
    them back from the config: `config.buffer.port`, `config.generator.weights_address`)."""
    ports = loopback_overrides(free_port(), free_port())
    wiring = {key.replace(".", "__"): value for key, value in ports.items()}
    return learner_config(model_dir, run__root=str(run_root), run__name="run", **{**wiring, **overrides})


def run_learner_to_end(config: TandemConfig, groups_per_step: int, group_size: int) -> SyntheticBuffer:
    """Run the learner role of `config` against a `SyntheticBuffer` until it exits (asserting exit code 0 within
    240 s); returns the buffer (closed) with what it recorded."""
    buffer = SyntheticBuffer(config.buffer.port, groups_per_step=groups_per_step, group_size=group_size)
    try:
        with RoleUnderTest(config, "learner") as learner:
            assert learner.wait(240) == 0, learner.tail()
    finally:
        buffer.close()
    return buffer


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
