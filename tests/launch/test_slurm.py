"""`tandem slurm` (issue 35): the sbatch scripts it writes, and a SIMULATION fleet run to its end by a real Slurm
(slurm-wlm's slurmctld and slurmd, started by benchmarks/slurm_lab.py on this machine), with a generator submitted
after the others to show the fleet grows by `sbatch --array`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from common.config import load_config
from launch.cli import main

SCRIPTS = ["buffer.sbatch", "generators.sbatch", "learner.sbatch", "submit.sh"]


def _write(tmp_path: Path, *overrides: str) -> Path:
    code = main(["slurm", "demo", "--run.root", str(tmp_path), "--run.name", "s", "--run.insecure", "true", *overrides])
    assert code == 0
    return tmp_path / "s" / "slurm"


def test_the_jobs_of_a_run_as_sbatch_scripts(tmp_path: Path) -> None:
    folder = _write(
        tmp_path,
        "--learner.nnodes", "2", "--learner.world_size", "4", "--learner.groups_per_step", "4",
        "--generator.count", "3",
        "--slurm.partition", "gpu", "--slurm.account", "rl", "--slurm.time_limit", "4:00:00",
        "--slurm.learner_gpus", "2", "--slurm.generator_gpus", "1", "--slurm.directives", '["--qos=high"]',
        "--slurm.setup", "source /shared/venv/bin/activate",
    )  # fmt: skip
    assert sorted(p.name for p in folder.iterdir()) == SCRIPTS
    for name in SCRIPTS:
        assert subprocess.run(["bash", "-n", str(folder / name)], check=False).returncode == 0, name
    learner, generators = (folder / "learner.sbatch").read_text(), (folder / "generators.sbatch").read_text()
    for text in (learner, generators):
        for directive in ("--partition=gpu", "--account=rl", "--time=4:00:00", "--qos=high"):
            assert f"#SBATCH {directive}\n" in text
        assert "source /shared/venv/bin/activate\n" in text
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n" in learner and "#SBATCH --gpus-per-node=2\n" in learner
    assert '--learner.node_rank "$SLURM_NODEID" --learner.master_addr "$MASTER"' in learner
    assert '--learner.buffer_address "$BUFFER:5555"' in learner
    assert "#SBATCH --array=0-2\n" in generators and "#SBATCH --gpus-per-task=1\n" in generators
    for override in (
        '--generator.index "$SLURM_ARRAY_TASK_ID"',
        '--generator.buffer_address "$BUFFER:5555"',
        '--generator.weights_address "$LEARNER:5556"',
        '--weights.relay_host "$(address)"',
    ):
        assert override in generators
    submit = (folder / "submit.sh").read_text()
    assert submit.index("buffer.sbatch") < submit.index("learner.sbatch") < submit.index("generators.sbatch")
    assert "--dependency=after:$buffer learner.sbatch" in submit
    config = load_config(folder.parent / "config.json", [])  # what every job reads: services on every address
    assert (config.buffer.host, config.learner.weights_host, config.learner.master_port) == (
        "0.0.0.0",
        "0.0.0.0",
        29500,
    )
    assert config.learner.nnodes == 2 and json.loads((folder.parent / "config.json").read_text())["slurm"]["account"]


def test_a_reward_service_and_broadcast_weights_get_their_addresses(tmp_path: Path) -> None:
    folder = _write(
        tmp_path, "--env.reward_model", "tiny", "--weights.transport", "broadcast", "--generator.count", "1"
    )
    assert (folder / "reward.sbatch").read_text().count("publish reward.addr") == 1
    generators = (folder / "generators.sbatch").read_text()
    assert "REWARD=$(wait_for reward.addr)" in generators and '--reward.address "$REWARD:5559"' in generators
    assert '--weights.broadcast_host "$LEARNER"' in generators
    assert '--weights.broadcast_host "$MASTER"' in (folder / "learner.sbatch").read_text()
    assert "reward=$(sbatch --parsable reward.sbatch)" in (folder / "submit.sh").read_text()


def test_a_run_whose_services_other_nodes_reach_needs_keys(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["slurm", "demo", "--run.root", str(tmp_path)]) == 2
    assert "run.curve_keys_dir: the roles of a Slurm run bind addresses other nodes reach" in capsys.readouterr().err
    assert not (tmp_path / "tandem").exists()


@pytest.mark.integration  # starts Slurm's daemons and the fleet's processes
@pytest.mark.timeout(300)
def test_a_simulated_fleet_runs_to_its_end_on_a_real_slurm_and_grows_by_an_array_task(tmp_path: Path) -> None:
    from benchmarks.slurm_lab import LabUnavailable, slurm_lab
    from benchmarks.slurm_run import run_on_slurm

    def one_more_generator(folder: Path) -> None:
        submitted = subprocess.run(
            ["sbatch", "--parsable", "--array=1-1", str(folder / "generators.sbatch")],
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr

    try:
        lab = slurm_lab()
        env = lab.__enter__()
    except LabUnavailable as error:
        pytest.fail(f"`tandem slurm` is tested on a real Slurm: {error}")
    try:
        result = run_on_slurm(tmp_path, steps=12, generators=1, env=env, after_submit=one_more_generator)
    finally:
        lab.__exit__(None, None, None)
    assert result["steps"] == list(range(1, 13)), result
    assert result["learner_done"] and result["buffer_stopped"], result
    assert result["generators_exited"] == 2 and len([o for o in result["outputs"] if o.startswith("generators")]) == 2
    assert not any(result["errors"].values()), result["errors"]
    print(f"a SIMULATION fleet on Slurm: {result['wall_s']} s from submission to the last job's end")
