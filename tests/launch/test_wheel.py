"""`pip install .` (not editable) gives a working `tandem` outside the checkout.

The wheel is built from a copy of the checkout's files (tracked, and untracked ones git does not ignore: what a
clone plus the work in progress holds), so that nothing setuptools leaves in the tree (`build/lib` can carry a
deleted module into a wheel) and nothing of the tree itself reaches the installed package. It is installed with
`--no-deps` into a fresh venv that sees this environment's dependencies through one `.pth` line: the directory is
added to sys.path, but the `.pth` hooks inside it do not run, so the editable install of the checkout stays out.
From a temporary directory, with the checkout nowhere on sys.path, `tandem --help`, `tandem config demo`,
`tandem demo` (simulated: real processes and sockets, stand-ins for vLLM and DeepSpeed) and
`tandem prepare-model --check` (transformers and vLLM load the embedded model) must work. The model check is
started with the module (a fixture) and runs while the other tests do.

    flock /tmp/tandem-heavy.lock .venv/bin/python -m pytest tests/launch/test_wheel.py -q   # ~45 s on 2 cores
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.testing import loopback_overrides, override_args

pytestmark = pytest.mark.integration  # builds a wheel and a venv, starts tandem and its roles

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("actors", "buffers", "common", "launch", "learners")  # the top-level layout, and all the wheel holds


class Installed:
    """A venv with the wheel installed; `tandem(...)` runs its console script from a directory outside the checkout."""

    def __init__(self, wheel: Path, venv: Path, cwd: Path) -> None:
        self.wheel, self.venv, self.cwd = wheel, venv, cwd
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
        self.env["PYTHONNOUSERSITE"] = "1"

    def run(self, argv: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, check=False, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=timeout_s
        )

    def start(self, *args: str, out: Path) -> subprocess.Popen:
        """`tandem ARGS` started (not waited for), stdout to `out`, stderr to `out`.err, in a session of its own."""
        with open(out, "w") as stdout, open(f"{out}.err", "w") as stderr:
            argv = [str(self.venv / "bin" / "tandem"), *args]
            return subprocess.Popen(
                argv, cwd=self.cwd, env=self.env, stdout=stdout, stderr=stderr, text=True, start_new_session=True
            )

    def tandem(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        result = self.run([str(self.venv / "bin" / "tandem"), *args], timeout_s)
        assert result.returncode == 0, f"tandem {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}"
        return result


def _copy_checkout(target: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if not source.is_symlink() and not source.is_file():
            continue  # deleted in the work tree, not yet committed
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target / name, follow_symlinks=False)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    source, wheels, venv, cwd = root / "source", root / "wheels", root / "venv", root / "elsewhere"
    cwd.mkdir()
    _copy_checkout(source)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    # --no-build-isolation: the build uses this environment's setuptools and needs no registry
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", str(source), "-w", str(wheels)]
    subprocess.run(build, check=True, capture_output=True, timeout=120)
    (wheel,) = wheels.glob("tandem_rl-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    install = [*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=120)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / "tandem-test-deps.pth").write_text("".join(f"{path}\n" for path in deps))
    return Installed(wheel, venv, cwd)


@pytest.fixture(scope="module", autouse=True)
def model_check(installed: Installed) -> Iterator[tuple[subprocess.Popen, Path]]:
    """`tandem prepare-model --check`, started as soon as the wheel is installed and waited for by its test: it runs
    while the module's other tests do (most of it is vLLM starting, one core importing; `tandem demo` simulates)."""
    out = installed.cwd.parent / "prepare-model.out"
    process = installed.start("prepare-model", "--check", out=out)
    try:
        yield process, out
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)  # its group: the vLLM check's processes with it
            process.wait()


def test_the_wheel_holds_every_module_and_the_packaged_configs(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    assert {name.split("/")[0] for name in names} == {*PACKAGES, "tandem_rl-0.1.0.dist-info"}
    expected = {
        path.relative_to(REPO).as_posix()
        for package in PACKAGES
        for path in (REPO / package).rglob("*")
        if path.suffix in (".py", ".toml") and "__pycache__" not in path.parts
    }
    assert "launch/configs/demo.toml" in expected and "actors/environments/sandbox_boot.py" in expected
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"


def test_the_installed_package_is_the_wheel_not_the_checkout(installed: Installed) -> None:
    probe = (
        "import importlib.util, json, sys, launch\n"
        "print(json.dumps({'launch': launch.__file__, 'path': sys.path, 'modules': sorted(sys.modules),\n"
        "    'tests': importlib.util.find_spec('tests') is not None,\n"
        "    'examples': importlib.util.find_spec('examples') is not None}))"
    )
    result = installed.run([str(installed.venv / "bin" / "python"), "-c", probe])
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert Path(seen["launch"]).is_relative_to(installed.venv)
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    inside = [p for p in seen["path"] if p not in deps and Path(p or installed.cwd).resolve().is_relative_to(REPO)]
    assert not inside, f"the checkout is on sys.path: {inside}"
    assert not seen["tests"] and not seen["examples"]
    assert not [m for m in seen["modules"] if "editable" in m], "the checkout's editable finder was loaded"


def test_help_and_the_packaged_configs(installed: Installed) -> None:
    help_text = installed.tandem("--help").stdout
    for command in ("demo", "run", "buffer", "generator", "learner", "ray", "config", "prepare-model"):
        assert command in help_text
    demo = json.loads(installed.tandem("config", "demo").stdout)
    assert demo["run"]["name"] == "demo" and demo["algo"]["estimator"] == "grpo" and demo["model"]["path"] == "smollm2"
    # --no-path-checks: its model, keys and run root are the cluster's (/mnt/shared), not this machine's
    cluster = installed.tandem("config", "gpu_cluster.toml", "--no-path-checks", "--learner.total_steps", "7")
    cluster = json.loads(cluster.stdout)
    assert cluster["learner"]["zero_stage"] == 3 and cluster["learner"]["total_steps"] == 7
    missing = installed.run([str(installed.venv / "bin" / "tandem"), "config", "nothing"])
    assert missing.returncode == 2 and "packaged configs by name: demo, gpu_cluster" in missing.stderr


def test_demo_runs_its_roles_from_the_wheel(installed: Installed, ports: tuple[int, int]) -> None:
    """`tandem demo` in simulation: the launcher starts the buffer, learner and generator as `python -m launch.cli`
    processes of the venv's interpreter, over real sockets; 3 learner steps."""
    overrides = {"run.simulate": True, "learner.total_steps": 3, "run.root": str(installed.cwd / "runs")}
    overrides |= loopback_overrides(*ports)
    installed.tandem("demo", *override_args(overrides), timeout_s=120)
    run_dir = installed.cwd / "runs" / "demo"
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [step["step"] for step in steps] == [1, 2, 3] and steps[-1]["policy_version"] == 3
    assert json.loads((run_dir / "config.json").read_text())["run"]["simulate"] is True


@pytest.mark.vllm
def test_prepare_model_check_loads_the_model_with_transformers_and_vllm(
    model_check: tuple[subprocess.Popen, Path],
) -> None:
    process, out = model_check
    code = process.wait(timeout=400)
    assert code == 0, f"tandem prepare-model --check exited {code}:\n{Path(f'{out}.err').read_text()[-3000:]}"
    output = out.read_text().strip().splitlines()
    assert (Path(output[0]) / "config.json").is_file()
    texts = ast.literal_eval(output[-1])  # {'transformers': text, 'vllm': text}
    assert set(texts) == {"transformers", "vllm"} and all(text.strip() for text in texts.values())
