"""The weight publisher's memory while peers ask for weights and never read them (issue 12, item 6).

    .venv/bin/python -m benchmarks.weights_slow_reader [--versions 30] [--snapshot-mib 16] [--deadline-s 1]
    git archive 9c61f34~1 | tar -x -C /tmp/before && cp benchmarks/weights_slow_reader.py /tmp/before/benchmarks/ &&
        (cd /tmp/before && /work/main/.venv/bin/python -m benchmarks.weights_slow_reader)   # the publisher before

Runs the checkout's `ZmqWeightsPublisher` in this process (4 MiB buckets) and, in another process, one raw DEALER
that sends a `WeightsRequest` after each of `--versions` publishes and never calls recv (RCVHWM 1, a 4 KiB receive
buffer: its ZeroMQ stops reading the socket after one reply, so the next stalls on the publisher). Prints this
process's resident memory (VmRSS) every 5 versions with the publisher's counters, then whether an honest client
still gets the newest version byte-exact, the final RSS and the peak (VmHWM). `--deadline-s` is passed only to a
publisher that has reader deadlines (the one before had none).
"""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
import time
from typing import Any

import numpy as np

from benchmarks.common import save
from common.sockets import Client, SocketSecurity, free_port
from common.weight_messages import WeightsHeader, WeightsRequest
from launch.testing import unpack_weights
from learners.publisher import ZmqWeightsPublisher

NON_READER = r"""
import struct, sys, time, zmq
from common.types import WeightsRequest
from common.wire import encode
sock = zmq.Context().socket(zmq.DEALER)
sock.setsockopt(zmq.RCVHWM, 1)
sock.setsockopt(zmq.RCVBUF, 4096)
sock.setsockopt(zmq.METADATA, b"X-Tandem-Role:generator")  # declared as a generator would (loopback, no keys)
sock.connect(f"tcp://127.0.0.1:{sys.argv[1]}")
for n, _ in enumerate(sys.stdin, 1):  # one request per line the benchmark writes (after each publish)
    sock.send_multipart([b"", struct.pack("<Q", n), *encode(WeightsRequest(generator_id=99, have_version=-1))])
time.sleep(3600)
"""


def status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The figures issue 12 quotes: the publisher process's memory before, during and after the flood of unread
    replies, and whether an honest generator still got the newest version."""
    keys = ("snapshot_mib", "versions", "rss_mb_start", "rss_mb_max_during", "rss_mb_end", "honest_byte_exact")
    return {key: result[key] for key in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--versions", type=int, default=30)
    parser.add_argument("--snapshot-mib", type=int, default=16)
    parser.add_argument("--deadline-s", type=float, default=60.0)
    args = parser.parse_args()
    port = free_port()
    options = {"bucket_bytes": 4 << 20}
    if "reader_deadline_s" in inspect.signature(ZmqWeightsPublisher).parameters:
        options["reader_deadline_s"] = args.deadline_s
    publisher = ZmqWeightsPublisher("127.0.0.1", port, SocketSecurity(), **options)
    layout = [(f"layer.{i}", "float32", [args.snapshot_mib << 16]) for i in range(4)]  # 4 x snapshot / 4 MiB
    arrays = [np.zeros(shape, np.float32) for _, _, shape in layout]
    reader = subprocess.Popen([sys.executable, "-c", NON_READER, str(port)], stdin=subprocess.PIPE, text=True)
    # a generator's role (checkouts before per-role identities have no `role`: their publisher serves anyone)
    role = {"role": "generator"} if "role" in inspect.signature(Client).parameters else {}
    during: list[float] = []
    try:
        time.sleep(1.0)
        start = status_mb("VmRSS")
        print(f"start: RSS {start:.0f} MB, snapshots of {args.snapshot_mib} MiB, {options}")
        for version in range(args.versions):
            for array in arrays:
                array.fill(version)
            publisher.publish(version, layout, zip([name for name, _, _ in layout], arrays))
            reader.stdin.write("ask\n")
            reader.stdin.flush()
            time.sleep(0.2)
            during.append(status_mb("VmRSS"))
            if version % 5 == 4:
                print(f"v{version}: RSS {status_mb('VmRSS'):.0f} MB  {dict(publisher.counters)}", flush=True)
        client = Client(f"127.0.0.1:{port}", SocketSecurity(), identity="honest-generator", **role)
        reply, payload = client.request(WeightsRequest(generator_id=0, have_version=-1), timeout_s=60)
        client.close()
        newest = isinstance(reply, WeightsHeader) and reply.policy_version == args.versions - 1
        exact = newest and all(bool((a == args.versions - 1).all()) for _, a in unpack_weights(reply, payload))
        print(f"honest client: v{getattr(reply, 'policy_version', reply)}, byte-exact {exact}")
        end = status_mb("VmRSS")
        print(f"end: RSS {end:.0f} MB, peak {status_mb('VmHWM'):.0f} MB")
        counters = dict(publisher.counters)
    finally:
        reader.kill()
        publisher.close()
    result = {
        "snapshot_mib": args.snapshot_mib,
        "versions": args.versions,
        "publisher_options": options,
        "rss_mb_start": start,
        "rss_mb_max_during": max(during),
        "rss_mb_end": end,
        "rss_mb_peak": status_mb("VmHWM"),
        "honest_byte_exact": exact,
        "publisher_counters": counters,
    }
    save("weights_slow_reader", {"headline": headline(result), **result})


if __name__ == "__main__":
    main()
