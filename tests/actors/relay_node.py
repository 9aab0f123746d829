"""A relay receiver in a process of its own, for tests/actors/test_relay.py: fetch until it holds a version, then
write what it holds (its version, the sha256 of its bytes, its counters) as JSON.

    python -m tests.actors.relay_node --publisher HOST:PORT --id 1 --store DIR --version 1 --out FILE \
        [--stop-after-chunks N] [--stall-timeout-s 1.0]

--stop-after-chunks N: after writing its N-th chunk the receive blocks for good while the relay server goes on
serving what it holds: a relay stuck in the middle of an update, that the test then kills.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from pathlib import Path

from actors.weights import host_copy
from actors.weights.updates import open_weights_source
from common.config import WeightsConfig
from common.sockets import SocketSecurity


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--publisher", required=True)
    parser.add_argument("--id", type=int, required=True)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--version", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop-after-chunks", type=int, default=0)
    parser.add_argument("--stall-timeout-s", type=float, default=1.0)
    args = parser.parse_args()
    if args.stop_after_chunks:
        write = host_copy.HostCopy.write_chunk

        def write_then_stop(copy: host_copy.HostCopy, index: int, data) -> None:
            write(copy, index, data)
            if index + 1 == args.stop_after_chunks:
                threading.Event().wait()

        host_copy.HostCopy.write_chunk = write_then_stop
    weights = WeightsConfig(stall_timeout_s=args.stall_timeout_s, host_id=f"host-{args.id}")
    source = open_weights_source(weights, args.publisher, SocketSecurity(), args.id, args.store)
    have = -1
    while have < args.version:
        result = source.fetch(have)
        if not isinstance(result, int):
            have = result.policy_version
            digest = hashlib.sha256()
            for bucket in result.buckets:
                digest.update(bucket)
        else:
            time.sleep(0.05)
    record = {"version": have, "sha256": digest.hexdigest(), "counters": dict(source.counters),
              "last": source.last_receive}  # fmt: skip
    args.out.write_text(json.dumps(record))
    source.close()


if __name__ == "__main__":
    main()
