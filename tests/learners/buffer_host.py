"""`SyntheticBuffer` as a process of its own, bound to HOST:PORT: the buffer of a test's own network (a host in a
network namespace, tests/learners/test_learner_hosts.py), which learner ranks on other hosts reach.

    python -m tests.learners.buffer_host HOST PORT GROUPS_PER_STEP GROUP_SIZE OUT

Writes OUT.ready once bound; serves until SIGTERM, then writes OUT: {"requests": [[step, rank, world_size], ...],
"reports": [[policy_version, step], ...]}, what it recorded.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

from tests.learners.learner_fakes import SyntheticBuffer


def main(host: str, port: str, groups_per_step: str, group_size: str, out: str) -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    hosted = type("HostedBuffer", (SyntheticBuffer,), {"host": host})
    buffer = hosted(int(port), groups_per_step=int(groups_per_step), group_size=int(group_size))
    Path(f"{out}.ready").touch()
    stop.wait()
    buffer.close()
    with buffer.lock:
        record = {
            "requests": [[r.step, r.rank, r.world_size] for r in buffer.requests],
            "reports": [[r.policy_version, r.step] for r in buffer.reports],
        }
    Path(out).write_text(json.dumps(record))


if __name__ == "__main__":
    main(*sys.argv[1:])
