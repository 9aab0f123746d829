"""`[slurm]`: what `tandem slurm` asks the Slurm cluster for, job by job."""

from __future__ import annotations

from pydantic import Field

from common.config.base import _Section


class SlurmConfig(_Section):
    """`tandem slurm CONFIG`: the sbatch scripts of a run (launch/slurm.py, docs/clusters.md). Every field is
    optional: unset, the cluster's defaults apply."""

    partition: str | None = Field(None, description="`--partition` of every job.")
    account: str | None = Field(None, description="`--account` of every job.")
    time_limit: str | None = Field(None, description="`--time` of every job (`1-00:00:00`, `4:00:00`).")
    buffer_cpus: int = Field(2, description="`--cpus-per-task` of the buffer's job.", ge=1)
    generator_cpus: int | None = Field(
        None, description="`--cpus-per-task` of each generator (a task of the generators' job array).", ge=1
    )
    generator_gpus: int = Field(0, description="`--gpus-per-task` of each generator (0 on CPU clusters).", ge=0)
    learner_cpus: int | None = Field(
        None, description="`--cpus-per-task` of the learner's task on each of its learner.nnodes nodes.", ge=1
    )
    learner_gpus: int = Field(
        0,
        description="`--gpus-per-node` of the learner's job: its world_size / nnodes ranks on each node (0 on CPU).",
        ge=0,
    )
    reward_cpus: int | None = Field(None, description="`--cpus-per-task` of the reward service's job.", ge=1)
    reward_gpus: int = Field(0, description="`--gpus-per-task` of the reward service's job.", ge=0)
    directives: list[str] = Field(
        [], description="More `#SBATCH` options for every job, as written after `#SBATCH ` (`--qos=high`)."
    )
    setup: str = Field(
        "",
        description="Shell lines every job runs before its role (`module load cuda; source /shared/venv/bin/"
        "activate`). Unset: the jobs run this Python (`python -m launch.cli`), which must exist on every node.",
    )
    address_command: str = Field(
        "hostname -I | cut -d' ' -f1",
        description="The shell command whose output is a node's address, as the other nodes reach it (the first "
        "address of `hostname -I` by default; `hostname -i`, or an interface's address on clusters with several).",
        min_length=1,
    )
    wait_s: int = Field(
        600, description="How long a job waits for the addresses of the jobs it needs (buffer, learner).", ge=1
    )
