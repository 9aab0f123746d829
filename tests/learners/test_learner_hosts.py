"""Learner ranks across hosts, started by hand (issue 35): `tandem learner CONFIG --learner.node_rank R` on two
hosts, each a network namespace this test builds (benchmarks/netns.py: a veth pair per host onto a bridge,
10.213.0.0/24), one rank on each, meeting at host 0 over gloo (learner.master_addr/master_port) and asking a buffer
on host 0 for their shares. With ZeRO-3 they make, step by step, the updates of the same two ranks started on one
host (learner.nnodes = 1) on the same batches.

Why ZeRO-3 alone (it ran with ZeRO-1 too, 40-55 s more of a 2-core CI machine): what this module tests is the wire
between hosts (the rendezvous at host 0, gloo over the hosts' own interfaces, the buffer's shares by rank and
node), and ZeRO-3 sends across it what ZeRO-1 sends (the gradients' reduction, the updated parameters' all-gather)
and its gathers of partitioned parameters besides. What differs with ZeRO-1 is the arithmetic on one host, which
tests/learners/test_data_parallel.py checks for both stages.

Tolerance: none, bit for bit. The two runs are the same two ranks on the same batches (the buffer's shares by
rank), each with one thread (OMP_NUM_THREADS = 1, so every kernel splits its sums alike), so each rank's gradient
is the same bits in both; the all-reduce of two ranks adds two numbers, which IEEE addition does alike in either
order, over a veth pair or over loopback, and what follows (the optimizer step, ZeRO-3's gathers) is the same
arithmetic on the same bits. Only the wire between the ranks differs. A rank that trained on the other's share, a
lost or doubled all-reduce, or a rank that met the other host's rank under another step shows as a difference."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import netns
from common.metrics import read_metrics
from common.sockets import free_port
from launch.testing import PACKAGE_ROOT, RoleUnderTest, wait_until
from tests.learners.learner_fakes import process_config, run_learner_to_end

pytestmark = pytest.mark.deepspeed

STEPS, GROUPS, GROUP_SIZE = 2, 2, 4
RDZV_PORT = 29_400  # inside the namespaces every port is free


def _trained(run_dir: Path) -> tuple[list[float], dict]:
    from safetensors.torch import load_file

    losses = [record["loss/policy"] for record in read_metrics(run_dir / "metrics.jsonl")]
    return losses, load_file(str(run_dir / "checkpoints" / f"step-{STEPS:06d}" / "hf" / "model.safetensors"))


def _two_hosts(model_dir: Path, root: Path, stage: int, net: netns.Lab) -> tuple[list[float], dict, dict]:
    host0 = net.hosts[0]
    buffer_port = free_port()
    config = process_config(
        model_dir,
        root,
        run__insecure=True,  # the namespaces' own network: nothing outside reaches it
        buffer__host=host0,  # what the buffer host binds (tests/learners/buffer_host.py)
        buffer__port=buffer_port,
        learner__buffer_address=f"{host0}:{buffer_port}",
        learner__world_size=2,
        learner__nnodes=2,
        learner__master_addr=host0,
        learner__master_port=RDZV_PORT,
        learner__zero_stage=stage,
        learner__total_steps=STEPS,
    )
    out, log = root / "buffer.json", root / "buffer.log"
    root.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "tests.learners.buffer_host", host0, str(buffer_port), str(GROUPS), str(GROUP_SIZE)]
    with log.open("w") as output:
        buffer = subprocess.Popen(
            net.exec_argv(0, [*argv, str(out)]), cwd=PACKAGE_ROOT, stdout=output, stderr=subprocess.STDOUT
        )
    try:
        wait_until(lambda: Path(f"{out}.ready").exists() or buffer.poll() is not None, 60, "the buffer host")
        assert buffer.poll() is None, f"the buffer host exited:\n{log.read_text()[-3000:]}"
        nodes = [
            RoleUnderTest(
                config,
                "learner",
                "--learner.node_rank",
                str(rank),
                index=rank,
                netns=net.namespaces[rank],
                env={"GLOO_SOCKET_IFNAME": net.links[rank]},  # the host's one interface, as on a real cluster
            )
            for rank in (0, 1)
        ]
        with nodes[0], nodes[1]:
            deadline = time.monotonic() + 300
            for node in nodes:
                assert node.wait(max(1.0, deadline - time.monotonic())) == 0, node.tail()
    finally:
        buffer.terminate()
        buffer.wait(30)
    losses, weights = _trained(config.run.run_dir)
    return losses, weights, json.loads(out.read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [3])  # ZeRO-1 too: see the module docstring
def test_ranks_on_two_hosts_make_the_updates_of_two_ranks_on_one(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: int
) -> None:
    try:
        netns.check_lab()
    except netns.LabUnavailable as error:
        pytest.fail(f"learners across hosts are tested in network namespaces, which this machine refuses: {error}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # both runs: see the module docstring

    one_host = process_config(
        tiny_model_dir,
        tmp_path / "one",
        learner__world_size=2,
        learner__zero_stage=stage,
        learner__total_steps=STEPS,
    )
    run_learner_to_end(one_host, groups_per_step=GROUPS, group_size=GROUP_SIZE)
    one_losses, one_weights = _trained(one_host.run.run_dir)

    with netns.lab(hosts=2, rate_mbit=1000) as net:
        two_losses, two_weights, buffer = _two_hosts(tiny_model_dir, tmp_path / "two", stage, net)

    assert sorted(map(tuple, buffer["requests"])) == [(s, r, 2) for s in range(STEPS) for r in (0, 1)]
    assert len(one_losses) == len(two_losses) == STEPS
    delta_weights = max(float((one_weights[k].float() - two_weights[k].float()).abs().max()) for k in one_weights)
    delta_loss = max(abs(a - b) for a, b in zip(one_losses, two_losses))
    print(f"ZeRO-{stage}: losses {two_losses}; max |d loss| = {delta_loss:.3g}, max |d weights| = {delta_weights:.3g}")
    assert one_weights.keys() == two_weights.keys()
    assert delta_loss == 0 and delta_weights == 0
