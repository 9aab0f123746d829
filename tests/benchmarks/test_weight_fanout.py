"""benchmarks.weight_fanout: its quick mode runs end to end over real network namespaces (star and relay, G = 1 and
4), writes the documented keys, every generator holds exactly the publisher's bytes, and the lab is gone after.

Needs root and iproute2 (CI runs as root): where namespaces cannot be made the test fails with the reason, it is
not skipped. Not a timing test: the figures checked are byte counts, which do not depend on the machine's load.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import benchmarks.common
from actors.weights.updates import WeightsUpdate, shared_memory_dir
from benchmarks import netns, weight_fanout
from launch.testing import pack_weights

ROW_KEYS = {"G", "transport", "publisher_bytes", "model_bytes", "latency_s", "updates", "all_bytes_matched"}
UPDATE_KEYS = {"latency_s", "publisher_bytes", "receive_s", "depth", "cpu_busy", "generator_cpu_s", "bytes_matched"}


def test_the_digest_of_an_update_is_the_digest_of_the_published_arrays() -> None:
    layout = weight_fanout.model_layout(1 << 20)
    assert abs(weight_fanout.layout_bytes(layout) - (1 << 20)) < (1 << 20) / 4  # a layer's bytes at most
    arrays = weight_fanout.version_arrays(layout, 3)
    assert weight_fanout.version_arrays(layout, 3)[1][1].tobytes() == arrays[1][1].tobytes()  # same in every process
    header, frames = pack_weights(dict(arrays), 3, bucket_bytes=256 << 10, dtypes={n: d for n, d, _ in layout})
    update = WeightsUpdate(header, [memoryview(frame) for frame in frames], received_at=0.0)
    assert weight_fanout.update_digest(update) == weight_fanout.arrays_digest(arrays)
    frames[-1][-1] ^= 1  # one flipped bit in the last tensor
    assert weight_fanout.update_digest(update) != weight_fanout.arrays_digest(arrays)
    assert weight_fanout.arrays_digest(weight_fanout.version_arrays(layout, 4)) != weight_fanout.arrays_digest(arrays)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_quick_mode_measures_both_transports_over_namespaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        netns.check_lab()
    except netns.LabUnavailable as error:
        pytest.fail(f"benchmarks.weight_fanout needs network namespaces on this machine: {error}")
    monkeypatch.setattr(benchmarks.common, "RESULTS", tmp_path / "results")
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = f"{netns.PREFIX}{dead.pid}-h0"  # what a killed run would leave: removed at the next start
    subprocess.run(["ip", "netns", "add", leftover], check=True)
    assert weight_fanout.main(["--quick"]) == 0
    assert leftover not in netns.namespace_names()
    result = json.loads((tmp_path / "results" / "weight_fanout.json").read_text())
    assert (tmp_path / "results" / "weight_fanout.png").is_file()
    rows = result["rows"]
    assert sorted((row["transport"], row["G"]) for row in rows) == [
        ("relay", 1),
        ("relay", 4),
        ("star", 1),
        ("star", 4),
    ]
    for row in rows:
        assert ROW_KEYS <= row.keys(), ROW_KEYS - row.keys()
        assert row["all_bytes_matched"], f"{row['transport']} G={row['G']}: a generator held other bytes"
        for update in row["updates"]:
            assert UPDATE_KEYS <= update.keys(), UPDATE_KEYS - update.keys()
            assert update["bytes_matched"] and len(update["receive_s"]) == row["G"]
            assert update["publisher_link_bytes"] >= update["publisher_bytes"]  # headers and requests on top
        reattached = sum(c.get("counters/reattachments", 0) for c in row["generator_counters"])
        if row["transport"] == "star":  # every tensor is a multiple of ALIGN bytes: buckets hold no padding
            assert row["publisher_bytes"] == row["G"] * row["model_bytes"]
        elif reattached == 0:  # a re-attachment may send some chunks twice
            assert row["publisher_bytes"] <= result["fanout_k"] * row["model_bytes"]
    assert result["headline"] == weight_fanout.headline(result) and result["headline"]["all_bytes_matched"]
    assert not [n for n in netns.namespace_names() if n.startswith(f"{netns.PREFIX}{os.getpid()}-")]
    assert not [n for n in netns.link_names() if n.startswith(f"{netns.PREFIX}{os.getpid()}")]
    assert not (shared_memory_dir() / f"{weight_fanout.WORK_PREFIX}{os.getpid()}").exists()


def test_the_lab_is_refused_with_a_reason_without_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.shutil, "which", lambda name: None)
    with pytest.raises(netns.LabUnavailable, match="apt-get install -y iproute2"):
        netns.check_lab()


def test_the_token_bucket_holds_a_timer_tick_of_the_rate() -> None:
    assert int(netns.token_bucket(10_000)[4]) == 5_000_000  # 10 Gbit/s: 1.25 GB/s x 4 ms
    assert int(netns.token_bucket(1)[4]) == 256 << 10  # slow links: a few GSO segments at least
