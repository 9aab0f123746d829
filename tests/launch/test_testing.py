"""The harness itself (launch/testing.py): the fake buffer leases the test's prompts through the real BufferCore,
roles die with their process group, and neither the harness nor the benchmarks pull in pytest or `tests.*`."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from common.sockets import Client, SocketSecurity
from common.types import GroupAck, LeaseGrant, LeaseRefused, LeaseRequest, LeaseReturn
from launch.testing import FakeBuffer, RoleUnderTest, arithmetic_items, run_config
from tests.buffers.fakes import make_group

ROOT = Path(__file__).resolve().parents[2]


def test_fake_buffer_leases_the_tests_prompts_through_the_core(tmp_path: Path) -> None:
    config = run_config(tmp_path, "fake", algo={"group_size": 4})
    with FakeBuffer(config, arithmetic_items(3, first_id=10), lease_size=2) as buffer:
        client = Client(config.generator.buffer_address, SocketSecurity(), identity="generator-0")
        try:
            grant = client.request(LeaseRequest(0, 4, 0), timeout_s=5)[0]
            assert isinstance(grant, LeaseGrant) and [p.prompt_id for p in grant.prompts] == [10, 11]  # lease_size
            first = client.request(make_group(grant.lease_id, grant.prompts[0]), timeout_s=5)[0]
            again = client.request(make_group(grant.lease_id, grant.prompts[0]), timeout_s=5)[0]
            assert (first.status, again.status) == ("accepted", "duplicate") and first.prompt_id == 10
            wrong_size = client.request(make_group(grant.lease_id, grant.prompts[1], size=3), timeout_s=5)[0]
            assert wrong_size == GroupAck(grant.lease_id, 11, "rejected", wrong_size.reason) and wrong_size.reason
            # the rejected prompt is re-issued first, then the last new one; a returned one comes back too
            regrant = client.request(LeaseRequest(0, 4, 1), timeout_s=5)[0]  # v1: the learner follows the generator
            assert [p.prompt_id for p in regrant.prompts] == [11, 12]
            client.request(LeaseReturn(0, regrant.lease_id, [12]), timeout_s=5)
            last = client.request(LeaseRequest(0, 4, 1), timeout_s=5)[0]
            assert [p.prompt_id for p in last.prompts] == [12]
            for lease, prompt in ((regrant, regrant.prompts[0]), (last, last.prompts[0])):
                assert (
                    client.request(make_group(lease.lease_id, prompt, version=1), timeout_s=5)[0].status == "accepted"
                )
            assert client.request(LeaseRequest(0, 4, 1), timeout_s=5)[0] == LeaseRefused("exhausted", 0, 0.2)
        finally:
            client.close()
    assert sorted(g.prompt_id for g in buffer.groups.values()) == [10, 11, 12]
    counters = buffer.counters()
    assert counters["duplicates"] == 1 and counters["rejected_wrong_group_size"] == 1
    assert np.all(buffer.groups[(regrant.lease_id, 11)].versions == 1)


@pytest.mark.integration
def test_a_role_is_killed_with_its_process_group(tmp_path: Path) -> None:
    config = run_config(tmp_path, "role", env={"num_prompts": 4})
    with RoleUnderTest(config, "buffer") as buffer:
        buffer.wait_until(lambda: "buffer on 127.0.0.1" in buffer.output(), 60, "the buffer's start line")
        pid = buffer.pid
    assert buffer.poll() == -signal.SIGKILL and not Path(f"/proc/{pid}").exists()
    assert buffer.output_path == config.run.run_dir / "logs" / "buffer-0.out"


@pytest.mark.integration
def test_the_harness_and_the_benchmarks_import_no_pytest_no_tests_and_no_engine() -> None:
    code = (
        "import sys, launch.testing, benchmarks.runs, benchmarks.generator_rig, benchmarks.weight_sync, "
        "benchmarks.generator_throughput, benchmarks.buffer_throughput\n"
        "bad = sorted(m for m in sys.modules if m in ('pytest', 'tests') or m.startswith(('tests.', '_pytest')))\n"
        "bad += sorted({'torch', 'vllm', 'deepspeed'} & set(sys.modules))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)
