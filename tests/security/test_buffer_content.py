"""Hostile values against the real buffer service (`tandem buffer` in its own process, loopback sockets):

- `VersionReport(policy_version=0, step=2**63)` passed validation, and the buffer died at its next TensorBoard
  write; its journal replayed the report, so every restart died again. Now the report is refused at decode, and a
  journal the old buffer wrote (the report, and a group with out-of-vocabulary ids) replays with both skipped;
- groups with token ids outside the vocabulary or negative, an empty prompt, NaN or infinite reward components,
  rewards of 3e38, positive log-probs or a prompt longer than the model takes were accepted and served. Each is now
  acked "rejected" with its reason, counted by kind within the ledger, and never served; the prompt is re-issued.
Each test asserts the attack fails and the service stays up (it answers, writes metrics, and stops cleanly).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from typing import Any

import numpy as np
import pytest

from buffers.journal import Journal
from buffers.service import journal_path, load_prompt_records
from buffers.state import BufferSettings, BufferState
from common.config import load_config
from common.sockets import Client
from common.types import (
    Batch,
    BatchRequest,
    ErrorReply,
    GroupAck,
    LeaseGrant,
    LeaseRequest,
    VersionReport,
)
from launch.testing import wait_until
from tests.buffers.fakes import GROUP, HOSTILE, MAX_MODEL_LEN, VOCAB, hostile_group, make_group
from tests.buffers.peers import SECURITY, call, stats
from tests.buffers.test_service import BufferProcess, _assert_balanced, buffers  # noqa: F401 - the fixture
from tests.security.test_semantic_fuzz import ETA, assert_trainable

# The fakes' limits (ids < 1000, prompt + completion <= 64 tokens) as the run's config.
LIMITS = {
    "buffer": {"vocab_size": VOCAB, "persist": True},
    "model": {"max_model_len": MAX_MODEL_LEN},
    "generator": {"max_tokens": MAX_MODEL_LEN // 2},
}


def _metrics_lines(buffer: BufferProcess) -> list[dict[str, Any]]:
    path = buffer.run_dir / "buffer.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _writes_metrics(buffer: BufferProcess) -> None:
    """The buffer writes two more metrics records (every 2 s): its loop, and TensorBoard's writer, are alive."""
    before = len(_metrics_lines(buffer))
    wait_until(lambda: len(_metrics_lines(buffer)) >= before + 2, 30, "two more metrics records", buffer)


def _client(buffer: BufferProcess, role: str) -> Client:
    return Client(buffer.address, SECURITY, identity=f"attacker-{role}", role=role)


@pytest.mark.integration
def test_a_version_report_with_step_2_63_is_refused_and_the_buffer_keeps_running(buffers) -> None:  # noqa: F811
    buffer = buffers(**LIMITS).start()
    deadline = time.monotonic() + 30
    reply = call(_client(buffer, "learner"), VersionReport(policy_version=0, step=2**63), deadline)
    assert isinstance(reply, ErrorReply) and "outside [0, 2147483647]" in reply.reason, reply
    counters = stats(buffer.address)
    assert counters["rejected_invalid_fields"] >= 1
    _writes_metrics(buffer)
    assert max(line["buffer/learner_version"] for line in _metrics_lines(buffer)) == 0
    # and a restart from its journal (nothing of the report was journaled) comes up and keeps running
    assert buffer.signal(signal.SIGKILL) == -signal.SIGKILL
    buffer.start()
    _writes_metrics(buffer)
    assert buffer.signal(signal.SIGTERM) == 0


def _old_journal(buffer: BufferProcess) -> int:
    """Write the journal the buffer before issue 12 left: a lease, a group with an out-of-vocabulary id accepted
    into it (that buffer had no content check), and the VersionReport(0, 2**63) it accepted. Returns the group's
    prompt id."""
    config = load_config(buffer.config_path)
    prompts = load_prompt_records(config.env, config.run.seed)
    journal = Journal(journal_path(buffer.run_dir))
    state = BufferState(BufferSettings.from_config(config), prompts, journal)
    state.restore(0.0)
    lease = state.grant(generator_id=0, policy_version=0, count=2, now=time.time())
    prompt_id = next(iter(lease.prompts))
    state.accept(hostile_group(lease.lease_id, (prompt_id, 0), "bad_token", size=GROUP), time.time())
    state.report_version(2**63, 0)  # the old core committed what passed its checks: this did
    state.save_counters()
    journal.close()
    return prompt_id


@pytest.mark.integration
def test_a_journal_with_the_old_buffers_hostile_records_replays_with_them_skipped(buffers) -> None:  # noqa: F811
    buffer = buffers(**LIMITS)
    _old_journal(buffer)
    buffer.start()
    counters = stats(buffer.address)
    assert counters["journal_skipped"] == 2 and counters["rejected_bad_token"] == 1, counters
    assert counters["buffered_groups"] == 0 and counters["rejected_groups"] == 1
    _assert_balanced(counters)
    _writes_metrics(buffer)
    assert {line["buffer/learner_version"] for line in _metrics_lines(buffer)} == {0}
    log = (buffer.run_dir / "logs" / "buffer-0.log").read_text()
    assert "skipped 2 of" in log and "outside the vocabulary" in log
    assert buffer.signal(signal.SIGTERM) == 0


def _hostile_cases(lease: LeaseGrant, generator_id: int) -> dict[str, Any]:
    """One hostile group per prompt of `lease` (expected rejection kind -> group)."""
    kinds = {
        "bad_token": "bad_token",
        "negative_token": "bad_token",
        "empty_prompt": "empty_prompt",
        "too_long": "too_long",
        "huge_reward": "bad_reward",
        "nan_component": "bad_reward",
        "inf_component": "bad_reward",
        "positive_logprob": "bad_logprob",
    }
    assert set(kinds) <= set(HOSTILE)
    cases = {}
    for (how, kind), prompt in zip(kinds.items(), lease.prompts):
        cases[f"{how}->{kind}"] = hostile_group(lease.lease_id, prompt, how, generator_id, size=GROUP)
    return cases


@pytest.mark.integration
def test_out_of_vocabulary_nan_and_huge_reward_groups_are_rejected_counted_and_never_served(buffers) -> None:  # noqa: F811
    buffer = buffers(learner={"groups_per_step": 8}, algo={"group_size": GROUP, "max_staleness": ETA}, **LIMITS)
    buffer.start()
    deadline = time.monotonic() + 60
    generator, learner = _client(buffer, "generator"), _client(buffer, "learner")
    lease = call(generator, LeaseRequest(0, 8, 0), deadline)
    assert isinstance(lease, LeaseGrant) and len(lease.prompts) == 8, lease
    for case, group in _hostile_cases(lease, 0).items():
        ack = call(generator, group, deadline)
        assert isinstance(ack, GroupAck) and ack.status == "rejected" and ack.reason, (case, ack)
    nan_reward = dataclasses.replace(
        make_group(lease.lease_id, lease.prompts[0], 0, GROUP), rewards=np.full(GROUP, np.nan, np.float32)
    )
    assert isinstance(call(generator, nan_reward, deadline), ErrorReply)  # not even well-formed: refused at decode
    counters = stats(buffer.address)
    expected = {"bad_token": 2, "empty_prompt": 1, "too_long": 1, "bad_reward": 3, "bad_logprob": 1}
    assert {kind: counters.get(f"rejected_{kind}", 0) for kind in expected} == expected, counters
    assert counters["rejected_groups"] == 8 and counters["buffered_groups"] == 0
    _assert_balanced(counters)
    # the rejected prompts are re-issued at once; clean groups for them are accepted and served, nothing else is
    again = call(generator, LeaseRequest(0, 8, 0), deadline)
    assert isinstance(again, LeaseGrant) and {p.prompt_id for p in again.prompts} == {
        p.prompt_id for p in lease.prompts
    }
    for prompt in again.prompts:
        assert call(generator, make_group(again.lease_id, prompt, 0, GROUP), deadline).status == "accepted"
    batch = call(learner, BatchRequest(0, 0, 1, 8, 5.0), deadline, timeout_s=10.0)
    assert isinstance(batch, Batch) and len(batch.groups) == 8, batch
    for group, lag in zip(batch.groups, batch.staleness):
        assert_trainable(group, lag, batch.step)
    _assert_balanced(stats(buffer.address))
    _writes_metrics(buffer)
    assert buffer.signal(signal.SIGTERM) == 0
