"""`tandem ray`'s decisions without a cluster: names, resources, endpoints, rank environments, the [ray] config,
the example GPU cluster config, and the `tandem ray scale|status|stop` command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import ConfigError, load_config
from launch.ray.plan import (
    Endpoints,
    actor_name,
    bind_problem,
    capacity_problem,
    distinct_port,
    fleet_config,
    learner_env,
    learner_processes,
    resource_demand,
)
from tests.launch.test_cli import run_help

REPO = Path(__file__).resolve().parents[2]
TANDEM = [sys.executable, "-m", "launch.cli"]


def test_actor_names_show_run_role_and_index() -> None:
    assert actor_name("exp1", "generator-3") == "tandem:exp1:generator-3"


def test_demand_counts_buffer_learner_processes_and_generators() -> None:
    config = load_config(
        None,
        {
            "generator.count": 4,
            "learner.world_size": 2,
            "learner.groups_per_step": 4,
            "ray.generator_cpus": 0.5,
            "ray.learner_gpus": 1,
            "ray.generator_gpus": 2,
            "generator.tensor_parallel_size": 2,
        },
    )
    assert resource_demand(config) == {"CPU": 1 + 2 * 1 + 4 * 0.5, "GPU": 2 * 1 + 4 * 2}
    assert resource_demand(config, generators=1)["GPU"] == 2 + 2
    simulated = load_config(None, {"learner.world_size": 2, "learner.groups_per_step": 4, "run.simulate": True})
    assert learner_processes(simulated) == 1  # one process stands for every rank in simulation


def test_capacity_problem_names_the_knobs_to_change() -> None:
    assert capacity_problem({"CPU": 3.0, "GPU": 0.0}, {"CPU": 4.0}, generators=1) is None
    message = capacity_problem({"CPU": 3.0, "GPU": 2.0}, {"CPU": 8.0, "GPU": 1.0}, generators=1)
    assert message is not None and "has 1 GPU" in message and "reserves 2" in message
    assert "ray.generator_gpus" in message


def test_fleet_config_fills_both_ends_of_every_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(
        None, {"run.root": "runs", "run.insecure": True, "learner.cpu_cores": "1", "generator.cpu_cores": "0"}
    )
    fleet = fleet_config(config, Endpoints("10.0.0.5", 41234, "10.0.0.7", 41801))
    assert fleet.run.root == tmp_path / "runs"  # absolute: roles run in other directories
    assert (fleet.buffer.host, fleet.buffer.port) == ("10.0.0.5", 41234)
    assert fleet.generator.buffer_address == fleet.learner.buffer_address == "10.0.0.5:41234"
    assert (fleet.learner.weights_host, fleet.learner.weights_port) == ("10.0.0.7", 41801)
    assert fleet.generator.weights_address == "10.0.0.7:41801"
    assert fleet.learner.cpu_cores == fleet.generator.cpu_cores == ""  # Ray places; no pinning
    ipv6 = fleet_config(config, Endpoints("fd00::5", 1, "fd00::7", 2))
    assert ipv6.generator.buffer_address == "fd00::5:1"  # host = everything before the last ':'


def test_demand_counts_the_reward_service_only_when_the_run_has_one() -> None:
    served = load_config(None, {"env.reward_model": "/models/rm", "ray.reward_cpus": 2, "ray.reward_gpus": 1})
    assert served.reward_service
    assert resource_demand(served) == {"CPU": 1 + 1 + 1 + 2, "GPU": 1}  # buffer, learner, generator, reward
    in_process = load_config(None, {"env.reward_model": "/models/rm", "reward.in_process": True, "ray.reward_cpus": 2})
    assert resource_demand(in_process) == {"CPU": 3, "GPU": 0}  # scored inside the generators: no service
    assert resource_demand(load_config(None, {"ray.reward_cpus": 2}))["CPU"] == 3  # no reward model at all
    message = capacity_problem(resource_demand(served), {"CPU": 8.0, "GPU": 0.0}, generators=1, reward=True)
    assert message is not None and "the reward service" in message and "ray.reward_gpus" in message
    plain = capacity_problem({"CPU": 9.0}, {"CPU": 8.0}, generators=1)
    assert plain is not None and "reward" not in plain and "the learner and 1 generator(s)" in plain


def test_fleet_config_points_the_generators_at_the_reward_service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(None, {"env.reward_model": "/models/rm", "run.insecure": True, "reward.cpu_cores": "1"})
    fleet = fleet_config(config, Endpoints("10.0.0.5", 41234, "10.0.0.7", 41801, "10.0.0.9", 41990))
    assert (fleet.reward.host, fleet.reward.port) == ("10.0.0.9", 41990)  # where it binds, on its node
    assert fleet.reward.address == "10.0.0.9:41990"  # where every generator reaches it
    assert fleet.reward.cpu_cores == ""  # Ray's reservation places it
    loopback = fleet_config(config, Endpoints("127.0.0.1", 41234, "127.0.0.1", 41801, "127.0.0.1", 41990))
    assert loopback.reward.address == "127.0.0.1:41990"
    without = fleet_config(load_config(None), Endpoints("127.0.0.1", 41234, "127.0.0.1", 41801))
    assert without.reward == load_config(None).reward  # no service: the section as written


def test_distinct_port_skips_the_other_services_ports() -> None:
    offered = iter([5555, 5556, 5555, 41990])
    assert distinct_port(lambda: next(offered), taken={5555, 5556}) == 41990
    with pytest.raises(RuntimeError, match="all returned one of"):
        distinct_port(lambda: 5555, taken={5555}, tries=3)


def test_a_port_with_a_listener_is_taken_until_it_closes() -> None:
    import socket

    from launch.ray.roles import port_taken

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    assert port_taken("127.0.0.1", port)
    listener.close()
    assert not port_taken("127.0.0.1", port)  # what a restarted reward service then binds


def test_status_lists_the_reward_service() -> None:
    from launch.ray.control import _describe

    def member(name: str) -> dict:
        return {"name": name, "index": 0, "node": "10.0.0.9", "node_id": "n", "pid": 7, "retiring": False}

    reply = {
        "run": "exp1",
        "buffer_address": "10.0.0.5:41234",
        "weights_address": "10.0.0.7:41801",
        "reward_address": "10.0.0.9:41990",
        "buffer": member("buffer-0"),
        "reward": member("reward-1"),
        "learners": [member("learner-0")],
        "generators": [member("generator-0")],
        "retiring": [],
        "restarts": {"generator": 0, "learner": 0, "reward": 1},
    }
    text = _describe("exp1", reply)
    assert "reward 10.0.0.9:41990" in text and "reward-1" in text
    plain = _describe("exp1", {**reply, "reward_address": None, "reward": None})
    assert "reward-1" not in plain and "reward 10." not in plain


def test_learner_env_counts_local_ranks_per_node() -> None:
    nodes = ["a", "a", "b", "a"]
    envs = [learner_env(rank, nodes, "10.0.0.7", 29500) for rank in range(4)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"] and {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "0", "2"]
    assert [e["LOCAL_WORLD_SIZE"] for e in envs] == ["3", "3", "1", "3"]
    assert envs[2]["MASTER_ADDR"] == "10.0.0.7" and envs[2]["MASTER_PORT"] == "29500"
    gpu = learner_env(3, nodes, "10.0.0.7", 29500, own_device=True)  # Ray shows each rank only its GPU
    assert (gpu["LOCAL_RANK"], gpu["LOCAL_WORLD_SIZE"]) == ("0", "1")


def test_binding_a_node_address_needs_keys_or_insecure(tmp_path: Path) -> None:
    plain = load_config(None)
    assert bind_problem("127.0.0.1", plain) is None
    problem = bind_problem("10.0.0.5", plain)
    assert problem is not None and "run.curve_keys_dir" in problem and "run.insecure" in problem
    assert bind_problem("10.0.0.5", load_config(None, {"run.curve_keys_dir": str(tmp_path)})) is None
    assert bind_problem("10.0.0.5", load_config(None, {"run.insecure": True})) is None


def test_ray_section_rules() -> None:
    with pytest.raises(ConfigError, match="ray.generator_gpus: must be 0"):
        load_config(None, {"generator.tensor_parallel_size": 2, "ray.generator_gpus": 1})
    with pytest.raises(ConfigError, match="ray.max_learner_restarts: needs learner.save_every"):
        load_config(None, {"ray.max_learner_restarts": 1})
    with pytest.raises(ConfigError, match="ray.generator_cpus"):
        load_config(None, {"ray.generator_cpus": -1})


@pytest.mark.integration
def test_example_gpu_cluster_config_validates() -> None:
    result = subprocess.run(
        [*TANDEM, "config", str(REPO / "examples" / "gpu_cluster.toml"), "--no-path-checks"],  # the cluster's paths
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    config = load_config(REPO / "examples" / "gpu_cluster.toml")
    # one GPU per engine for a 1.5B model (review finding 15): 16 x 1 + 4 learner ranks = 20 GPUs
    assert (config.generator.count, config.generator.tensor_parallel_size, config.ray.generator_gpus) == (16, 1, 1)
    assert (config.learner.world_size, config.learner.zero_stage, config.ray.learner_gpus) == (4, 3, 1)
    assert resource_demand(config)["GPU"] == 20 and config.generator.enforce_eager is False


@pytest.mark.integration
def test_ray_control_commands_answer_help_at_once() -> None:
    result, seconds = run_help("ray", "scale", "--help")  # checks that no engine, Ray included, was imported
    assert "--generators" in result.stdout
    assert seconds < 10.0  # only a backstop for a loaded machine: importing no Ray is what makes it answer at once
    missing = subprocess.run(
        [*TANDEM, "ray", "scale", "some-run"], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert missing.returncode == 2 and "--generators" in missing.stderr


def test_status_of_a_run_that_is_over_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A local run whose cluster has shut down is answered from its record (launch.ray.local), without Ray."""
    import ray

    from launch.ray import control as ray_control
    from launch.ray import local as ray_local

    monkeypatch.setattr(ray_local, "RECORDS", tmp_path)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh `tandem ray status` process
    monkeypatch.setattr(ray, "init", lambda **_: pytest.fail("a run that is over needs no Ray"))
    not_a_head = os.getpid()  # alive, but not a `launch.ray.local` head: the cluster is gone
    finished = {"outcome": "finished", "code": 0}
    ray_local.LocalCluster(
        "done", str(tmp_path / "done"), not_a_head, not_a_head, "10.0.0.5:6379", "token", finished
    ).save()
    for action in (["status", "done"], ["stop", "done"], ["scale", "done", "--generators", "2"]):
        assert ray_control.main(action) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, err
        assert f"tandem ray {action[0]}: run done is over: finished (code 0)" in err, err


def test_a_cluster_that_is_not_there_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import ray

    from launch.ray import control as ray_control
    from launch.testing import free_port

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # an address where nothing listens: answered by a TCP connect, not by Ray's minutes of retries
    assert ray_control.main(["status", "some-run", "--address", f"127.0.0.1:{free_port()}"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not answer" in err, err

    def no_ray_here(**_: object) -> None:  # what ray.init(address="auto") raises with no Ray on this machine
        raise ConnectionError("Could not find any running Ray instance.\n" + "  (Ray's traceback)\n" * 20)

    monkeypatch.setattr(ray, "init", no_ray_here)
    assert ray_control.main(["status", "some-run"]) == 1  # no address and no local cluster of that name: auto
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no Ray cluster runs on this machine" in err, err


def test_scale_room_says_what_is_free_and_what_was_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from launch.ray.placement import BundlePool, Slot

    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 0.5, "CPU_group_ab12": 1.0, "memory": 1e9})
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    pool = BundlePool("r", "generator", {"CPU": 0.5, "GPU": 0.0}, "SPREAD", timeout_s=120)
    assert pool.room_problem(1) is None  # 0.5 CPU free holds one more
    problem = pool.room_problem(3)
    assert problem == (
        "3 more generator(s) reserve 1.5 CPU (0.5 each); the cluster has 0.5 CPU free of 2: lower "
        "ray.generator_cpus, ask for fewer, or add nodes"
    )
    pool.free = [Slot(group=None, index=0), Slot(group=None, index=1)]  # freed bundles of its groups come first
    assert pool.room_problem(3) is None


def test_a_role_given_no_gpu_sees_none() -> None:
    """Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for an actor given no GPU (review finding 11): the role's own
    environment blanks it; a role given GPUs keeps what Ray set."""
    from launch.ray.roles import gpu_isolated

    assert gpu_isolated({"A": "1"}, []) == {"A": "1", "CUDA_VISIBLE_DEVICES": ""}
    assert gpu_isolated({"A": "1"}, ["3"]) == {"A": "1"}
