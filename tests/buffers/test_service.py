"""The buffer service as its own process (`python -m launch.cli buffer cfg.toml`) over real loopback sockets,
with fake generators and a fake learner: a generator killed mid-lease loses no prompt; a buffer killed with
SIGKILL and restarted from its journal loses no accepted group; 10,000 fuzzed messages do not bring it down
and every one is answered and counted; SIGTERM and SIGINT stop it cleanly; it imports no engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from common.sockets import Client
from common.types import VersionReport
from launch.testing import RoleUnderTest, run_config
from tests.buffers.peers import SECURITY, Generator, Learner, call, stats

ROOT = Path(__file__).resolve().parents[2]
GROUP = 4


class BufferProcess(RoleUnderTest):
    """`tandem buffer` from a test config under `tmp_path`; answers stats once started; always killed by the fixture."""

    def __init__(self, tmp_path: Path, **sections: dict[str, Any]) -> None:
        defaults: dict[str, dict[str, Any]] = {
            "run": {"seed": 0},
            "buffer": {"capacity": 64, "heartbeat_timeout_s": 1.0, "lease_timeout_s": 30.0, "epochs": 1},
            "algo": {"group_size": GROUP, "max_staleness": 1},
            "env": {"num_prompts": 24},
            "learner": {"groups_per_step": 2},
        }
        for section, values in sections.items():
            defaults.setdefault(section, {}).update(values)
        config = run_config(tmp_path / "runs", "buffer-test", **defaults)
        super().__init__(config, "buffer")
        self.address = config.generator.buffer_address

    def start(self) -> BufferProcess:
        super().start()
        self.wait_until(lambda: _answers(self.address), 60, "the buffer's first answer")
        return self

    def signal(self, signum: int) -> int:
        return self.stop(grace_s=20, signum=signum)


def _answers(address: str) -> bool:
    try:
        stats(address, timeout_s=1.0)
        return True
    except TimeoutError:
        return False


@pytest.fixture
def buffers(tmp_path: Path):
    """Makes BufferProcess objects and kills any still running at teardown."""
    made: list[BufferProcess] = []

    def make(**sections: dict[str, Any]) -> BufferProcess:
        made.append(BufferProcess(tmp_path, **sections))
        return made[-1]

    yield make
    for buffer in made:
        buffer.kill()


def _assert_balanced(counters: dict[str, int]) -> None:
    outflows = sum(counters[k] for k in ("trained", "dropped_stale", "evicted", "rejected", "buffered"))
    assert counters["arrived"] == outflows, counters


def _assert_every_prompt_accepted_once_and_accounted(
    learner: Learner, generators: list, total: int, lost_acks: bool = False
) -> None:
    """`lost_acks`: a kill may have lost the ack of a group already journalled; the generator resends it and is
    told "duplicate" (the buffer holds it), so such a prompt, acked duplicate and never accepted, counts as held."""
    accepted = [(pid, epoch) for g in generators for _, pid, epoch in g.acks["accepted"]]
    if lost_acks:
        duplicates = {(pid, epoch) for g in generators for _, pid, epoch in g.acks["duplicate"]}
        accepted += sorted(duplicates - set(accepted))
    assert sorted(accepted) == [(pid, 0) for pid in range(total)]  # every prompt of the epoch, exactly once
    learned = [(pid, epoch) for _, pid, epoch in learner.groups]
    assert len(learned) == len(set(learned)) and set(learned) <= set(accepted)  # nothing served twice or invented
    # the rest was dropped as too stale (counted) or is still buffered, fewer than one batch
    assert len(learned) + learner.dropped + learner.left == total and learner.left < learner.num_groups


def _join(*threads: Any, timeout: float = 60.0) -> None:
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), f"{type(thread).__name__} did not finish"
        assert thread.error is None, repr(thread.error)


@pytest.mark.integration
def test_generator_killed_mid_lease_loses_no_prompt(buffers) -> None:
    buffer = buffers().start()
    hanging = subprocess.Popen(
        [sys.executable, "-m", "tests.buffers.peers", "hang", buffer.address, "9"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert hanging.stdout.readline().strip() == "leased 4"  # all that admission allows at v0: (0+1+1)*2
        hanging.kill()
    finally:
        hanging.kill()
        hanging.wait(timeout=10)
    deadline = time.monotonic() + 60
    learner = Learner(buffer.address, num_groups=2, total_groups=24, max_staleness=1, deadline=deadline)
    generators = [Generator(buffer.address, i, learner, GROUP, deadline) for i in (0, 1)]
    for thread in (learner, *generators):
        thread.start()
    _join(learner, *generators)

    _assert_every_prompt_accepted_once_and_accounted(learner, generators, 24)
    assert learner.max_seen_staleness <= 1
    counters = stats(buffer.address)
    assert counters["leases_expired"] >= 1 and counters["prompts_reissued"] >= 4 and counters["generators_lost"] >= 1
    assert counters["trained_groups"] + counters["dropped_stale_groups"] + counters["buffered_groups"] == 24
    _assert_balanced(counters)
    assert all(g.refusals.get("exhausted") for g in generators)

    assert buffer.signal(signal.SIGTERM) == 0
    log = (buffer.run_dir / "logs" / "buffer-0.log").read_text()
    assert "generator 9 silent" in log and "buffer stopped (SIGTERM)" in log
    metrics = [json.loads(line) for line in (buffer.run_dir / "buffer.jsonl").read_text().splitlines()]
    assert metrics[-1]["buffer/trained_groups"] == len(learner.groups) and "buffer/staleness_mean" in metrics[-1]


@pytest.mark.integration
def test_buffer_killed_and_restarted_from_its_journal_loses_no_accepted_group(buffers) -> None:
    buffer = buffers(
        buffer={"persist": True, "lease_timeout_s": 3.0, "heartbeat_timeout_s": 2.0},
        algo={"group_size": GROUP, "max_staleness": 3},
        env={"num_prompts": 40},
    ).start()
    deadline = time.monotonic() + 90
    learner = Learner(buffer.address, num_groups=2, total_groups=40, max_staleness=3, deadline=deadline)
    generators = [Generator(buffer.address, i, learner, GROUP, deadline, delay_s=0.02) for i in (0, 1)]
    for thread in (learner, *generators):
        thread.start()
    while len(learner.groups) < 6 or sum(len(g.acks["accepted"]) for g in generators) < 12:
        assert time.monotonic() < deadline and learner.is_alive()
        time.sleep(0.01)
    assert buffer.signal(signal.SIGKILL) == -signal.SIGKILL
    accepted_before = {key for g in generators for key in g.acks["accepted"]}
    buffer.start()  # same config, same port: resumes from <run_dir>/buffer/journal.bin
    _join(learner, *generators, timeout=90)

    # A group journalled just before the SIGKILL whose ack the kill lost is resent and acked "duplicate": the
    # buffer holds it once. At most one per generator (each has one group in flight when the buffer dies).
    acked = {s: {(pid, epoch) for g in generators for _, pid, epoch in g.acks[s]} for s in ("accepted", "duplicate")}
    lost = acked["duplicate"] - acked["accepted"]
    assert len(lost) <= len(generators), lost
    _assert_every_prompt_accepted_once_and_accounted(learner, generators, 40, lost_acks=True)
    assert learner.max_seen_staleness <= 3
    counters = stats(buffer.address)
    _assert_balanced(counters)
    assert counters["trained_groups"] == len(learner.groups) and counters["buffered_groups"] == learner.left
    assert counters["dropped_stale_groups"] == learner.dropped
    assert len(accepted_before) >= 12
    assert buffer.signal(signal.SIGINT) == 0  # Ctrl-C stops it cleanly too
    log = (buffer.run_dir / "logs" / "buffer-0.log").read_text()
    assert "resumed from" in log and "buffer stopped (SIGINT)" in log


@pytest.mark.integration
def test_ten_thousand_fuzzed_messages_are_answered_counted_and_survived(buffers) -> None:
    from tests.buffers.fuzz import fuzz_buffer

    buffer = buffers(run={"max_message_mb": 1.0}).start()
    outcome = fuzz_buffer(buffer.address, count=10_000, seed=0)
    print(outcome)
    assert outcome.sent == 10_000 and outcome.unanswered == 0
    assert buffer.poll() is None
    counters = stats(buffer.address)
    rejected_by_kind = {k: v for k, v in counters.items() if k.startswith("rejected_") and k != "rejected_groups"}
    # every refusal is counted under a kind: ErrorReplies, envelopes too broken to answer, and groups acked "rejected"
    assert sum(rejected_by_kind.values()) == outcome.error_replies + outcome.bad_envelopes + outcome.rejected_acks
    for kind in (
        "garbage",
        "oversized",
        "wrong_version",
        "unknown_type",
        "bad_frames",
        "invalid_fields",
        "bad_envelope",
        "unknown_lease",
        "bad_rank",
        "unexpected_message",
        "forbidden_role",
    ):
        assert counters.get(f"rejected_{kind}", 0) > 0, kind
    _assert_balanced(counters)
    assert outcome.error_replies > 5_000
    # and it still works: a normal lease, group and batch (after the learner resets the version that fuzzed
    # VersionReports may have moved)
    deadline = time.monotonic() + 30
    reset = Client(buffer.address, SECURITY, identity="reset", role="learner")
    assert call(reset, VersionReport(0, 0, resync=True), deadline).learner_version == 0
    learner = Learner(buffer.address, num_groups=2, total_groups=2, max_staleness=1, deadline=deadline)
    generator = Generator(buffer.address, 1, learner, GROUP, deadline)
    learner.start()
    generator.start()
    try:
        _join(learner, timeout=30)
        assert len(learner.groups) >= 2
    finally:
        generator.stop.set()
        generator.join(10)
    assert buffer.signal(signal.SIGTERM) == 0
    assert os.path.getsize(buffer.run_dir / "logs" / "buffer-0.log") > 0


def test_prompts_come_from_the_env_section(tmp_path: Path) -> None:
    from buffers.service import load_prompt_records
    from common.config import EnvConfig
    from common.tasks import arithmetic_prompts, is_held_out

    arithmetic = load_prompt_records(EnvConfig(kind="arithmetic", num_prompts=5, difficulty=2), seed=3)
    assert [r.prompt_id for r in arithmetic] == list(range(5))
    assert arithmetic == load_prompt_records(EnvConfig(kind="arithmetic", num_prompts=5, difficulty=2), seed=3)
    assert arithmetic == arithmetic_prompts(5, seed=3, difficulty=2, split="train")  # env.split's default
    held_out = load_prompt_records(EnvConfig(num_prompts=50, split="held_out"), seed=3)
    assert all(is_held_out(r.metadata["expression"]) for r in held_out)
    assert load_prompt_records(EnvConfig(num_prompts=5, split="all"), seed=3) == arithmetic_prompts(
        5, seed=3, difficulty=1
    )
    source = tmp_path / "prompts.jsonl"
    source.write_text('{"prompt": "1 + 1?", "answer": 2}\n{"prompt": "2 + 2?", "answer": 4}\n')
    records = load_prompt_records(EnvConfig(kind="file", source=str(source)), seed=0)
    assert [(r.messages[0]["content"], r.metadata["answer"]) for r in records] == [("1 + 1?", 2), ("2 + 2?", 4)]


@pytest.mark.integration
def test_the_buffer_imports_no_engine() -> None:
    code = (
        "import sys, buffers.service, buffers.core; from common.config import EnvConfig; "
        "buffers.service.load_prompt_records(EnvConfig(num_prompts=3), 0); "
        "heavy = {'torch', 'transformers', 'vllm', 'deepspeed'} & set(sys.modules); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_the_buffer_socket_takes_what_the_largest_group_needs_and_refuses_a_limit_too_small() -> None:
    from buffers.service import socket_security
    from common.config import ConfigError, load_config
    from common.types import max_group_bytes

    config = load_config(None)  # group_size 8, max_model_len 1024: groups of at most ~0.18 MB
    assert socket_security(config).max_message_bytes == 2 * max_group_bytes(8, 1024) + (1 << 20)
    small = load_config(None, {"run.max_message_mb": 0.5, "learner.groups_per_step": 16})
    with pytest.raises(ConfigError, match="run.max_message_mb"):
        socket_security(small)  # 16 such groups (one rank's share of a batch) are ~2.7 MiB
