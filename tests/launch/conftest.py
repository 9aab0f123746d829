"""Fixtures of the `tandem ray` tests: a multi-node Ray cluster on this machine, CurveZMQ keys."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

NODES = 3
NODE_CPUS = 2  # logical CPUs Ray may hand out per node (this machine has 2 real cores in all)
OBJECT_STORE_BYTES = 100 * 1024 * 1024  # Tandem moves no data through Ray's object store


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """A Ray cluster of NODES nodes (separate raylets) on this machine, with this process connected to it;
    yields its address. Every node has the same IP, so placement is real but the network is loopback."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": NODE_CPUS, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False},
    )
    try:
        for _ in range(NODES - 1):
            cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=OBJECT_STORE_BYTES)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace="tandem", log_to_driver=False)
        yield cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="session")
def curve_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CurveZMQ server and per-role keys (`tandem keys`): on a Ray cluster the services bind the node's
    (non-loopback) IP."""
    from common.keys import write_keys

    keys = tmp_path_factory.mktemp("curve") / "keys"
    write_keys(keys)
    return keys
