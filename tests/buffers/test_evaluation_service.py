"""The buffer service evaluating (`tandem buffer` with an [eval] section) over real loopback sockets: the learner's
final report opens the final round, a generator is granted the set ahead of training prompts and its result
is one record of `<run_dir>/eval.jsonl` at step = its policy_version; RunOver and the exit wait for it."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from common.eval_messages import EvalGrant, EvalResult
from common.sockets import Client
from common.types import Heartbeat, LeaseRequest, Ok, RunOver, VersionReport
from tests.buffers.peers import SECURITY, call, stats
from tests.buffers.test_service import BufferProcess

SET_PROMPTS = 3  # eval.max_prompts: the first 3 held-out level-1 expressions


@pytest.mark.integration
def test_the_final_round_is_leased_answered_written_and_then_the_run_ends(tmp_path: Path) -> None:
    buffer = BufferProcess(
        tmp_path, eval={"sets": ["arithmetic"], "greedy": True, "samples": 1, "max_prompts": SET_PROMPTS}
    ).start()
    learner = Client(buffer.address, SECURITY, identity="learner", role="learner")
    generator = Client(buffer.address, SECURITY, identity="generator-0", role="generator")
    try:
        deadline = time.monotonic() + 60
        assert isinstance(call(learner, VersionReport(0, 0, resync=True, final=True), deadline), Ok)
        assert stats(buffer.address)["eval_final_pending"] == 1
        assert isinstance(call(generator, Heartbeat(0, 0, []), deadline), Ok)  # not RunOver: the round waits
        grant = call(generator, LeaseRequest(0, 4, 0), deadline)
        assert isinstance(grant, EvalGrant) and grant.set_name == "arithmetic" and len(grant.prompts) == SET_PROMPTS
        assert all("answer" in p.metadata for p in grant.prompts)
        total = SET_PROMPTS * grant.per_prompt
        right = np.tile(np.array([1, 0], np.int8), SET_PROMPTS)  # greedy right, the sample wrong
        result = EvalResult(
            0, grant.lease_id, 0, [p.prompt_id for p in grant.prompts], right.astype(np.float32),
            np.full(total, 7, np.int32), np.zeros(total, np.uint8), right, right, right,
            started_at=10.0, finished_at=11.0,
        )  # fmt: skip
        assert call(generator, result, deadline).status == "accepted"
        counters = stats(buffer.address)
        assert counters["eval_final_pending"] == 0 and counters["eval_done"] == SET_PROMPTS
        assert call(generator, Heartbeat(0, 0, []), deadline) == RunOver(step=0)
        assert buffer.wait(30) == 0  # every live generator was told and holds no lease
    finally:
        learner.close()
        generator.close()
        buffer.stop(signum=signal.SIGTERM)
    records = [json.loads(line) for line in (buffer.run_dir / "eval.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["step"] == 0
    row = records[0]
    assert row["eval/arithmetic/greedy/strict_accuracy"] == 1.0 and row["eval/arithmetic/strict_accuracy"] == 0.0
    assert row["eval/arithmetic/prompts"] == SET_PROMPTS and row["eval/arithmetic/wall_s"] == 1.0
    assert (buffer.run_dir / "tb" / "eval").is_dir()
    buffer_records = (buffer.run_dir / "buffer.jsonl").read_text().splitlines()
    assert json.loads(buffer_records[-1])["buffer/eval_results_accepted"] == 1
    last_line = (buffer.run_dir / "logs" / "buffer-0.log").read_text().splitlines()[-1]
    assert "buffer stopped" in last_line and f"eval_done {SET_PROMPTS}" in last_line, last_line
