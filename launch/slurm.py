"""`tandem slurm CONFIG [--submit]`: a run's jobs on a Slurm cluster, as sbatch scripts (and submitted).

    tandem slurm my_run.toml               # writes <run_dir>/config.json and <run_dir>/slurm/*.sbatch, submit.sh
    tandem slurm my_run.toml --submit      # ... and runs submit.sh: sbatch every job
    sbatch --array=4-7 runs/<name>/slurm/generators.sbatch     # four more generators, at any time

The jobs, each its own allocation (so that the fleets scale and fail apart):
  buffer      one task: writes its node's address to `slurm/buffer.addr`, then `tandem buffer`.
  reward      with env.reward_model (a reward service): one task, `slurm/reward.addr`, then `tandem reward`.
  learner     learner.nnodes nodes, one task each (srun): node 0 writes `slurm/learner.addr` (the weight publisher
              and the ranks' rendezvous, learner.master_addr); node R runs `tandem learner --learner.node_rank R`
              with world_size / nnodes ranks (learners/ranks.py).
  generators  a job array of generator.count tasks, generator.index = SLURM_ARRAY_TASK_ID; more are one
              `sbatch --array` away (an index is an identity: give new ones indices not in use).
A job waits (slurm.wait_s at most) for the address files of the jobs it talks to, and passes them as overrides
(`--generator.buffer_address ADDR:PORT` ...); submit.sh removes old address files and submits the learner and
the generators with `--dependency=after:<buffer>` (they start once the buffer has).

Shared paths: the run directory (config.json, the address files, checkpoints written by every learner node, logs)
and run.curve_keys_dir must be on a filesystem every node sees. Every role binds its node's address (0.0.0.0), so
`tandem slurm` refuses a config without run.curve_keys_dir unless run.insecure. Ports: buffer.port,
learner.weights_port, learner.master_port (29500 when unset), reward.port and, per generator, a free relay port;
they must be open between the nodes. docs/clusters.md has the whole picture.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from common.config import TandemConfig, write_resolved
from learners.ranks import MULTI_HOST_PORT

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # what the jobs put on PYTHONPATH: actors/ buffers/ ... launch/
SLURM_DIR = "slurm"
WILDCARD = "0.0.0.0"


def run(config: TandemConfig, submit: bool = False) -> int:
    """Write the scripts (and submit them); the exit code."""
    refused = refusal(config)
    if refused:
        print(f"tandem slurm: {refused}", file=sys.stderr)
        return 2
    folder = write_jobs(config)
    print(f"tandem slurm: wrote {', '.join(sorted(p.name for p in folder.iterdir() if p.is_file()))} to {folder}")
    if not submit:
        print(f"submit with: bash {folder / 'submit.sh'}")
        return 0
    if shutil.which("sbatch") is None:
        print("tandem slurm: --submit needs `sbatch` on this machine's PATH (a Slurm login node)", file=sys.stderr)
        return 2
    return subprocess.run(["bash", str(folder / "submit.sh")], check=False).returncode


def refusal(config: TandemConfig) -> str | None:
    if config.run.curve_keys_dir is None and not config.run.insecure:
        return (
            "run.curve_keys_dir: the roles of a Slurm run bind addresses other nodes reach: make keys on the shared "
            "path with `tandem keys DIR` and set run.curve_keys_dir = DIR (or run.insecure = true on a trusted "
            "private network)"
        )
    if config.run.placement != "split":
        return 'run.placement: "colocated" is a `tandem run` placement; Slurm places each job: leave it out'
    return None


def job_config(config: TandemConfig) -> TandemConfig:
    """The config every job reads: each service binds its node's every address; the rendezvous port is fixed."""
    return config.model_copy(
        update={
            "buffer": config.buffer.model_copy(update={"host": WILDCARD}),
            "learner": config.learner.model_copy(
                update={
                    "weights_host": WILDCARD,
                    "master_port": config.learner.master_port or MULTI_HOST_PORT,
                }
            ),
            "reward": config.reward.model_copy(update={"host": WILDCARD}),
        }
    )


def write_jobs(config: TandemConfig) -> Path:
    """`<run_dir>/config.json` (the jobs' config) and `<run_dir>/slurm/`: the sbatch scripts and submit.sh."""
    jobs = job_config(config)
    config_path = write_resolved(jobs, config.run.run_dir.resolve())
    folder = config.run.run_dir.resolve() / SLURM_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in render(jobs, config_path, folder).items():
        (folder / name).write_text(text)
    return folder


def render(config: TandemConfig, config_path: Path, folder: Path) -> dict[str, str]:
    """File name -> text of every script of the run (see the module docstring)."""
    slurm, learner = config.slurm, config.learner
    port = {
        "buffer": config.buffer.port,
        "weights": learner.weights_port,
        "reward": config.reward.port,
    }
    broadcast = config.weights.transport == "broadcast"
    scripts = {
        "buffer.sbatch": _script(
            config,
            config_path,
            folder,
            "buffer",
            [f"--cpus-per-task={slurm.buffer_cpus}"],
            'publish buffer.addr\nexec $TANDEM buffer "$CONFIG"',
        ),
    }
    learner_body = f"""BUFFER=$(wait_for buffer.addr)
export BUFFER
srun --kill-on-bad-exit=1 bash -c '
if [ "$SLURM_NODEID" = 0 ]; then
    publish "learner-$SLURM_JOB_ID.addr"
    MASTER=$(address)
else
    MASTER=$(wait_for "learner-$SLURM_JOB_ID.addr")
fi
if [ "$SLURM_NODEID" = 0 ]; then cp "$SLURM_DIR/learner-$SLURM_JOB_ID.addr" "$SLURM_DIR/.learner.addr.$$" && mv "$SLURM_DIR/.learner.addr.$$" "$SLURM_DIR/learner.addr"; fi
exec $TANDEM learner "$CONFIG" --learner.node_rank "$SLURM_NODEID" --learner.master_addr "$MASTER" \\
    --learner.buffer_address "$BUFFER:{port["buffer"]}"{' --weights.broadcast_host "$MASTER"' if broadcast else ""}
'"""
    learner_options = [f"--nodes={learner.nnodes}", "--ntasks-per-node=1"]
    learner_options += [f"--cpus-per-task={slurm.learner_cpus}"] if slurm.learner_cpus else []
    learner_options += [f"--gpus-per-node={slurm.learner_gpus}"] if slurm.learner_gpus else []
    scripts["learner.sbatch"] = _script(config, config_path, folder, "learner", learner_options, learner_body)
    generator_options = [f"--array=0-{config.generator.count - 1}", "--ntasks=1"]
    generator_options += [f"--cpus-per-task={slurm.generator_cpus}"] if slurm.generator_cpus else []
    generator_options += [f"--gpus-per-task={slurm.generator_gpus}"] if slurm.generator_gpus else []
    waits = ["BUFFER=$(wait_for buffer.addr)", "LEARNER=$(wait_for learner.addr)"]
    overrides = [
        '--generator.index "$SLURM_ARRAY_TASK_ID"',
        f'--generator.buffer_address "$BUFFER:{port["buffer"]}"',
        f'--generator.weights_address "$LEARNER:{port["weights"]}"',
        '--weights.relay_host "$(address)"',
    ]
    if broadcast:
        overrides.append('--weights.broadcast_host "$LEARNER"')
    if config.reward_service:
        waits.append("REWARD=$(wait_for reward.addr)")
        overrides.append(f'--reward.address "$REWARD:{port["reward"]}"')
        reward_options = [f"--cpus-per-task={slurm.reward_cpus}"] if slurm.reward_cpus else []
        reward_options += [f"--gpus-per-task={slurm.reward_gpus}"] if slurm.reward_gpus else []
        scripts["reward.sbatch"] = _script(
            config, config_path, folder, "reward", reward_options, 'publish reward.addr\nexec $TANDEM reward "$CONFIG"'
        )
    generator_body = "\n".join([*waits, 'exec $TANDEM generator "$CONFIG" \\', "    " + " \\\n    ".join(overrides)])
    scripts["generators.sbatch"] = _script(
        config, config_path, folder, "generators", generator_options, generator_body, array=True
    )
    scripts["submit.sh"] = _submit(config, sorted(scripts))
    return scripts


def _script(
    config: TandemConfig,
    config_path: Path,
    folder: Path,
    job: str,
    options: list[str],
    body: str,
    array: bool = False,
) -> str:
    slurm = config.slurm
    directives = [
        f"--job-name=tandem-{config.run.name}-{job}",
        f"--output={folder}/{job}-%{'A_%a' if array else 'j'}.out",
    ]
    directives += [f"--partition={slurm.partition}"] if slurm.partition else []
    directives += [f"--account={slurm.account}"] if slurm.account else []
    directives += [f"--time={slurm.time_limit}"] if slurm.time_limit else []
    directives += [*options, *slurm.directives]
    tandem = f"{shlex.quote(sys.executable)} -m launch.cli"
    return f"""#!/bin/bash
# Written by `tandem slurm` for run {config.run.name} ({job}); launch/slurm.py says what each job does.
{chr(10).join(f"#SBATCH {d}" for d in directives)}
set -euo pipefail
cd {shlex.quote(str(Path.cwd()))}
{slurm.setup}
export PYTHONPATH={shlex.quote(str(PACKAGE_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}
export TANDEM={shlex.quote(tandem)} CONFIG={shlex.quote(str(config_path))} SLURM_DIR={shlex.quote(str(folder))}
address() {{ {slurm.address_command}; }}
publish() {{ local tmp="$SLURM_DIR/.$1.$$"; address > "$tmp"; mv "$tmp" "$SLURM_DIR/$1"; }}
wait_for() {{
    local waited=0
    until [ -s "$SLURM_DIR/$1" ]; do
        if [ "$waited" -ge {slurm.wait_s} ]; then
            echo "tandem slurm: no $SLURM_DIR/$1 after {slurm.wait_s}s: is its job running (squeue)?" >&2
            exit 1
        fi
        sleep 1; waited=$((waited + 1))
    done
    cat "$SLURM_DIR/$1"
}}
export -f address publish wait_for
{body}
"""


def _submit(config: TandemConfig, scripts: list[str]) -> str:
    reward = "reward.sbatch" in scripts
    return f"""#!/bin/bash
# Submit the jobs of run {config.run.name} (written by `tandem slurm`): the buffer first, the others after it starts.
set -euo pipefail
cd "$(dirname "$0")"
rm -f buffer.addr learner.addr reward.addr learner-*.addr
buffer=$(sbatch --parsable buffer.sbatch)
{"reward=$(sbatch --parsable reward.sbatch)" if reward else ""}
learner=$(sbatch --parsable --dependency=after:$buffer learner.sbatch)
generators=$(sbatch --parsable --dependency=after:$buffer generators.sbatch)
echo "$buffer {"$reward " if reward else ""}$learner $generators" > jobs
echo "tandem slurm: buffer job $buffer,{" reward job $reward," if reward else ""} learner job $learner, generators job $generators \\
(array 0-{config.generator.count - 1}). More generators: sbatch --array=N-M $PWD/generators.sbatch. Stop: scancel $(cat jobs)"
"""
