"""Process placement of the learner: one command starts every data-parallel rank, and ranks pin their cores.

    if config.learner.world_size > 1 and "RANK" not in os.environ:
        return launch_ranks(config)          # torchrun --nproc_per_node N -m launch.cli learner <resolved config>
        # with learner.nnodes > 1, on each host: torchrun --nnodes M --node_rank R --master_addr A --master_port P
        # launch_ranks(config, "sft"): the same for an offline stage (-m launch.cli sft ...; rm, dpo)
    pin_cores(config.learner.cpu_cores, rank, world_size)

`launch_ranks` writes the resolved config into the run directory (`config.json`, so the ranks read exactly the
config this process validated, however it was built: file, overrides or code) and runs torchrun on it,
returning its exit code. torchrun gives each rank RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT and stops
the other ranks when one fails. Each rank gets OMP_NUM_THREADS = usable cores / ranks (unless already set;
torchrun's own default is 1).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from common.config import LearnerConfig, TandemConfig, parse_cores, write_resolved
from common.signals import caught_signals
from common.sockets import free_port

log = logging.getLogger("tandem.learner.ranks")
MULTI_HOST_PORT = 29500  # learner.master_port's default across hosts (torchrun's): every host must name the same


def torchrun_command(
    config_path: Path, learner: LearnerConfig, master_port: int, command: str = "learner"
) -> list[str]:
    """torchrun running `tandem COMMAND CONFIG` (`learner`, or an offline stage: `sft`, `rm`, `dpo`) as this host's
    share of `learner.world_size` ranks: all of them on one host, world_size / nnodes on host `node_rank`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(learner.nnodes),
        "--node_rank",
        str(learner.node_rank),
        "--nproc_per_node",
        str(learner.world_size // learner.nnodes),
        "--master_addr",
        learner.master_addr,
        "--master_port",
        str(master_port),
        "-m",
        "launch.cli",
        command,
        str(config_path),
    ]


def launch_ranks(config: TandemConfig, command: str = "learner") -> int:
    """Run `learner.world_size` ranks of `tandem COMMAND` (the learner, or an offline stage: sft, rm, dpo) under
    torchrun and wait; returns torchrun's exit code, or 128 + the signal when interrupted, as a single rank
    (also when the ranks had to be terminated past learner.stop_timeout_s).

    Ctrl-C or a launcher's SIGTERM reaches the whole process group (this process, torchrun and the ranks): the
    ranks stop after their step and checkpoint (`learners.learner`), torchrun forwards SIGTERM and gives them its
    own 30 s. This process does not die first (a launcher waiting on it would kill the ranks mid-save): it waits for
    torchrun up to learner.stop_timeout_s, then terminates it.
    """
    learner = config.learner
    # every host writes its own copy (a shared run directory): host 0's is the run's config.json
    name = "config.json" if learner.node_rank == 0 else f"config-node{learner.node_rank}.json"
    path = write_resolved(config, config.run.run_dir, name)
    port = learner.master_port or (MULTI_HOST_PORT if learner.nnodes > 1 else free_port())
    argv = torchrun_command(path, learner, port, command)
    here = learner.world_size // learner.nnodes
    log.info("starting %d of %d %s ranks: %s", here, learner.world_size, command, " ".join(argv))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // here)))
    process = subprocess.Popen(argv, env=env)
    with caught_signals() as signalled:
        deadline: float | None = None  # once signalled: when to stop waiting for the ranks
        try:
            while True:
                try:
                    code = process.wait(timeout=0.5)
                    return 128 + signalled[0] if signalled and code != 0 else code  # torchrun says 1 for the ranks' 130
                except subprocess.TimeoutExpired:
                    if signalled and deadline is None:
                        deadline = time.monotonic() + config.learner.stop_timeout_s
                    if deadline is not None and time.monotonic() > deadline:
                        log.warning("the ranks did not stop within learner.stop_timeout_s: terminating torchrun")
                        break
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
    return 128 + signalled[0]  # the ranks outlived learner.stop_timeout_s after a signal: interrupted, not done


def pin_cores(spec: str, local_rank: int, local_world: int) -> list[int] | None:
    """Pin this rank to its share of `spec`'s cores (an equal, contiguous slice per local rank) and size torch's
    thread pool to it. Empty spec: nothing changes (returns None). Raises ValueError for unavailable cores or
    fewer cores than ranks."""
    if not spec:
        return None
    import torch

    cores = sorted(parse_cores(spec, "learner.cpu_cores"))
    available = os.sched_getaffinity(0)
    if not set(cores) <= available:
        raise ValueError(
            f"learner.cpu_cores: cores {sorted(set(cores) - available)} are not available "
            f"(this process may use {sorted(available)})"
        )
    if len(cores) < local_world:
        raise ValueError(f"learner.cpu_cores: {len(cores)} cores for {local_world} ranks; give each rank >= 1")
    share = len(cores) // local_world
    mine = cores[local_rank * share : (local_rank + 1) * share]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))
    return mine
