"""The relay transport end to end (learners/publisher.py + learners/fanout.py -> actors/weights/relay.py): every generator
gets the publisher's exact bytes, the publisher sends each update k times whatever the fleet, a bad relay is caught
and dropped, a killed relay's children still reach the version, and a generator that joins is current within one
update."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from actors.weights.host_copy import HostCopy
from actors.weights.relay import NoRelay, RelayWeightsSource, open_relay_server
from actors.weights.updates import WeightsUpdate, open_weights_source
from common.config import WeightsConfig
from common.sockets import SocketSecurity, free_port
from launch.testing import wait_until
from learners.fanout import FanoutTree
from learners.publisher import ZmqWeightsPublisher
from learners.snapshot import copy_into_snapshot
from tests.shm_fakes import small_shared_memory

CHUNK = 256 << 10
BUCKET = 1 << 20


def model(seed: int) -> tuple[list[tuple[str, str, list[int]]], list[tuple[str, np.ndarray]]]:
    """~4 MB in 5 buckets (a tensor larger than a bucket gets one of its own), bfloat16 as 16-bit words."""
    rng = np.random.default_rng(seed)
    arrays = [
        ("embed.weight", rng.integers(0, 2**16, (1024, 1280), dtype=np.uint16), "bfloat16"),
        ("layer.weight", rng.standard_normal((300, 700)).astype(np.float32), "float32"),
        ("norm.weight", rng.standard_normal(333).astype(np.float32), "float32"),
    ]
    return [(n, d, list(a.shape)) for n, a, d in arrays], [(n, a) for n, a, _ in arrays]


def publisher_sha(version: int, seed: int) -> str:
    layout, weights = model(seed)
    digest = hashlib.sha256()
    for bucket in copy_into_snapshot(version, layout, weights, BUCKET).buckets:
        digest.update(bucket)
    return digest.hexdigest()


def sha(update: WeightsUpdate) -> str:
    digest = hashlib.sha256()
    for bucket in update.buckets:
        digest.update(bucket)
    return digest.hexdigest()


@pytest.fixture
def publisher(request: pytest.FixtureRequest):
    fanout, port = getattr(request, "param", 2), free_port()
    pub = ZmqWeightsPublisher(
        "127.0.0.1", port, SocketSecurity(), bucket_bytes=BUCKET, hold_s=0.0,
        relay=FanoutTree(fanout, relay_fanout=1), chunk_bytes=CHUNK,
    )  # fmt: skip
    ADDRESSES[id(pub)] = f"127.0.0.1:{port}"
    yield pub
    pub.close()


ADDRESSES: dict[int, str] = {}


def address(pub: ZmqWeightsPublisher) -> str:
    return ADDRESSES[id(pub)]


def sources(pub: ZmqWeightsPublisher, store: Path, hosts: list[str]) -> list[RelayWeightsSource]:
    return [
        open_weights_source(WeightsConfig(host_id=host, stall_timeout_s=1.0), address(pub), SocketSecurity(), i, store)
        for i, host in enumerate(hosts)
    ]


def fetch_all(fleet: list[RelayWeightsSource], have: int) -> list[WeightsUpdate]:
    results: dict[int, WeightsUpdate] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.setdefault(i, fleet[i].fetch(have))) for i in range(len(fleet))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return [results[i] for i in range(len(fleet))]


def publish(pub: ZmqWeightsPublisher, version: int, seed: int = 0) -> None:
    layout, weights = model(seed)
    pub.publish(version, layout, weights)
    assert pub.wait_for(version, timeout_s=30)  # served once its digests are computed (off the caller's thread)


def test_every_generator_gets_the_publishers_bytes_and_the_publisher_sends_k_copies(publisher, tmp_path) -> None:
    fleet = sources(publisher, tmp_path, ["a", "b", "c", "c", "d", "e", "f", "g"])  # 7 hosts, 8 generators
    try:
        publish(publisher, 1)
        updates = fetch_all(fleet, -1)
        model_bytes = updates[0].nbytes
        assert {update.policy_version for update in updates} == {1}
        assert {sha(update) for update in updates} == {publisher_sha(1, seed=0)}
        assert publisher.bytes_by_version[1] == 2 * model_bytes  # k = 2, whatever the fleet
        assert sum(s.counters["host_copies_mapped"] for s in fleet) == 1  # host c: one transfer, two generators
        assert len(list(tmp_path.glob("v1-g*.bin"))) == 7  # one copy per host
        depths = sorted(s.last_receive["depth"] for s in fleet)
        assert depths[:2] == [1, 1] and max(depths) == 4  # two chains over 7 hosts: 1 + 3 hops
        staged_path, tensors = updates[0].staged
        with open(staged_path, "rb") as file:  # what vLLM's workers map: the tensors at their offsets
            data = file.read()
        name, _, _, offset, nbytes = tensors[1]
        layer = dict(model(0)[1])[name]
        assert data[offset : offset + nbytes] == layer.tobytes()
    finally:
        for source in fleet:
            source.close()
    assert not tmp_path.exists() or not list(tmp_path.glob("*.bin"))  # each generator deleted its copies


def test_host_copies_move_out_of_a_shared_memory_too_small_for_them_together(publisher, tmp_path, monkeypatch) -> None:
    """A container's small /dev/shm (review finding 10): the store moves to the temporary directory before the
    first copy is written (no SIGBUS), and both generators of the host move alike, so they still share one copy."""
    shm, tmp = small_shared_memory(monkeypatch, tmp_path, free_bytes=1 << 20)  # the model: ~3.4 MB
    fleet = sources(publisher, shm / "tandem-weights-run", ["a", "a"])
    try:
        publish(publisher, 1)
        updates = fetch_all(fleet, -1)
        assert {sha(update) for update in updates} == {publisher_sha(1, seed=0)}
        assert {source.store_dir for source in fleet} == {tmp / "tandem-weights-run"}
        assert sum(s.counters["host_copies_mapped"] for s in fleet) == 1  # still one transfer for the host
        assert len(list((tmp / "tandem-weights-run").glob("v1-g*.bin"))) == 1 and not list(shm.rglob("*.bin"))
    finally:
        for source in fleet:
            source.close()
    layout, weights = model(0)
    header = dataclasses.replace(
        copy_into_snapshot(2, layout, weights, BUCKET).header, transport="relay", chunk_bytes=CHUNK
    )
    with pytest.raises(OSError, match="1 MiB free for 3 MiB"):  # a store that stays put: refused, not written
        HostCopy.create(shm, header, 0)


@pytest.mark.parametrize("publisher", [1], indirect=True)
def test_a_relay_that_alters_a_chunk_is_dropped_and_its_child_still_gets_the_exact_bytes(publisher, tmp_path) -> None:
    fleet = sources(publisher, tmp_path, ["a", "b"])
    evil = fleet[0]
    offer = evil.relay.offer

    def offer_altered(copy: HostCopy) -> None:
        view = copy.chunk_view

        def altered(index: int) -> memoryview:
            data = bytearray(view(index))
            data[len(data) // 2] ^= 0x01  # one bit
            return memoryview(bytes(data))

        copy.chunk_view = altered
        offer(copy)

    evil.relay.offer = offer_altered
    try:
        publish(publisher, 1)
        first = evil.fetch(-1)  # the evil relay receives honestly, then serves altered chunks
        honest = fleet[1].fetch(-1)  # k = 1: its parent is the evil relay
        assert sha(first) == sha(honest) == publisher_sha(1, seed=0)
        assert fleet[1].counters["bad_chunks"] == 1 and fleet[1].counters["reattached/bad_chunk"] == 1
        assert publisher.relay.counters["bad_relays"] == 1
        assert fleet[1].last_receive["parent"] == ""  # re-attached to the publisher
    finally:
        for source in fleet:
            source.close()


def test_a_generator_that_joins_is_attached_and_current_within_one_update(publisher, tmp_path) -> None:
    fleet = sources(publisher, tmp_path, ["a", "b", "c"])
    try:
        publish(publisher, 1)
        assert [u.policy_version for u in fetch_all(fleet, -1)] == [1, 1, 1]
        joiner = sources(publisher, tmp_path, ["a", "b", "c", "d"])[3]  # a fourth host, mid-run
        fleet.append(joiner)
        assert joiner.fetch(-1).policy_version == 1  # it asks at once: the newest version
        publish(publisher, 2, seed=1)
        updates = fetch_all(fleet, 1)
        assert [u.policy_version for u in updates] == [2, 2, 2, 2]
        assert {sha(u) for u in updates} == {publisher_sha(2, seed=1)}
        assert 3 in publisher.relay.depths(2)  # attached in v2's tree
        assert publisher.bytes_by_version[2] == 2 * updates[0].nbytes
    finally:
        for source in fleet:
            source.close()


@pytest.mark.integration
@pytest.mark.parametrize("publisher", [1], indirect=True)
def test_a_relay_killed_in_the_middle_of_an_update_leaves_its_children_complete_and_exact(publisher, tmp_path) -> None:
    """One chain (k = 1): publisher -> A -> B -> C. A's receive stops after 4 of 20 chunks (its relay server goes
    on); B takes those 4 from it and C attaches under B; A is then killed. B must re-attach (A stalled) and both
    reach v1 with the publisher's bytes. B and C wait 3 x 3 s for a stuck parent, far longer than starting C."""
    publish(publisher, 1)
    store = tmp_path / "store"
    out = {name: tmp_path / f"{name}.json" for name in "ABC"}

    def start(name: str, gid: int, *extra: str) -> subprocess.Popen:
        command = [sys.executable, "-m", "tests.actors.relay_node", "--publisher", address(publisher), "--id",
                   str(gid), "--store", str(store), "--version", "1", "--out", str(out[name]), "--stall-timeout-s",
                   "3", *extra]  # fmt: skip
        return subprocess.Popen(command, cwd=Path(__file__).resolve().parents[2])

    def done(gid: int) -> int:
        path = store / f"v1-g{gid}.bin"
        try:
            with open(path, "rb") as file:
                header = file.read(48)
        except FileNotFoundError:
            return -1
        return int.from_bytes(header[16:24], "little") if len(header) == 48 else -1

    nodes = {"A": start("A", 0, "--stop-after-chunks", "4")}
    try:
        wait_until(lambda: done(0) == 4, timeout_s=60, what="A stopped after 4 chunks")
        nodes["B"] = start("B", 1)
        wait_until(lambda: 1 in publisher.relay.parents(1), timeout_s=60, what="B attached")
        nodes["C"] = start("C", 2)
        wait_until(lambda: 2 in publisher.relay.parents(1), timeout_s=60, what="C attached")
        wait_until(lambda: done(1) == 4, timeout_s=60, what="B holding what A had")
        assert publisher.relay.parents(1)[2] != "" and publisher.relay.parents(1)[1] != ""  # C under B, B under A
        os.kill(nodes["A"].pid, signal.SIGKILL)
        for name in "BC":
            assert nodes[name].wait(timeout=60) == 0
        records = {name: json.loads(out[name].read_text()) for name in "BC"}
        assert {r["sha256"] for r in records.values()} == {publisher_sha(1, seed=0)}
        assert records["B"]["counters"].get("reattached/stalled", 0) >= 1
        assert publisher.relay.counters["reattached/stalled"] >= 1
    finally:
        for process in nodes.values():
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)


def test_a_generator_whose_relay_cannot_run_still_receives_as_a_leaf(publisher, tmp_path) -> None:
    """A relay that may not bind (non-loopback without keys or run.insecure) is off, logged; the generator is a leaf."""
    assert isinstance(open_relay_server("192.0.2.1", SocketSecurity(), 1.0, 0), NoRelay)
    leaf = open_weights_source(WeightsConfig(host_id="a", relay_host="192.0.2.1"), address(publisher),
                               SocketSecurity(), 0, tmp_path)  # fmt: skip
    try:
        publish(publisher, 1)
        assert sha(leaf.fetch(-1)) == publisher_sha(1, seed=0)
        assert publisher.relay.parents(1) == {0: ""}
        assert "digest_ms" not in publisher.counters  # nobody was fed by a relay: no digest was computed
    finally:
        leaf.close()


def test_a_host_copy_is_reused_only_once_nothing_maps_it(tmp_path) -> None:
    """A writer takes an old file of its own for a new version (warm pages) only when no HostCopy anywhere holds it:
    a reader whose load is still to come keeps its bytes intact."""
    layout, weights = model(0)
    base = copy_into_snapshot(1, layout, weights, BUCKET).header

    def header(version: int):
        return dataclasses.replace(base, policy_version=version, transport="relay", chunk_bytes=CHUNK)

    def write_all(copy: HostCopy, fill: int) -> None:
        for index in range(copy.total):
            _, start, end = copy.ranges[index]
            copy.write_chunk(index, bytes([fill]) * (end - start))

    first = HostCopy.create(tmp_path, header(1), 0)
    write_all(first, 1)
    inode = os.stat(first.path).st_ino
    reader = HostCopy.open(tmp_path, header(1), 0)  # another generator on the host, its load to come
    del first
    third = HostCopy.create(tmp_path, header(3), 0)  # v1 is older than v3 - 1, but still mapped: a new file
    third_inode = os.stat(third.path).st_ino
    assert third_inode != inode
    write_all(third, 3)
    assert reader.complete() and set(bytes(reader.buckets()[0][:4096])) == {1}
    del reader, third
    fifth = HostCopy.create(tmp_path, header(5), 0)
    assert os.stat(fifth.path).st_ino == third_inode and fifth.done == 0  # the newest free one, re-initialised
    assert not (tmp_path / "v3-g0.bin").exists()


def test_a_relay_bound_on_every_interface_advertises_the_address_that_routes_to_the_publisher() -> None:
    relay = open_relay_server("0.0.0.0", SocketSecurity(insecure=True), 1.0, 0, toward="127.0.0.1:5556")
    try:
        assert relay.address.startswith("127.0.0.1:")  # not 0.0.0.0, which another machine cannot dial
    finally:
        relay.close()
