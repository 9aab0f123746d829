"""How `make test` splits the suite between its two pytest-xdist workers (tests/conftest.py, worker_scope)."""

from __future__ import annotations

from tests.conftest import worker_scope


def test_a_module_is_one_unit_and_every_ray_module_shares_one() -> None:
    assert worker_scope("tests/launch/test_run_e2e.py::test_tandem_run_end_to_end[0]") == "tests/launch/test_run_e2e.py"
    assert worker_scope("tests/launch/test_run_e2e.py::test_tandem_run_end_to_end[2]") == "tests/launch/test_run_e2e.py"
    assert worker_scope("tests/buffers/test_core.py::TestLeases::test_expiry") == "tests/buffers/test_core.py"
    assert worker_scope("tests/launch/test_ray_fleet.py::test_scale") == worker_scope(
        "tests/launch/test_ray_real.py::t"
    )
    assert worker_scope("tests/launch/test_ray_real.py::t") == "ray"
    assert worker_scope("tests/launch/test_run_ray_like.py::t") == "tests/launch/test_run_ray_like.py"


class FakeItem:
    def __init__(self, nodeid: str, *markers: str) -> None:
        self.nodeid, self.markers = nodeid, markers

    def get_closest_marker(self, name: str) -> object:
        return name if name in self.markers else None


def test_units_go_out_costliest_first_measured_or_else_by_what_their_tests_start(tmp_path, monkeypatch) -> None:
    from tests import conftest

    durations = tmp_path / "durations.json"
    durations.write_text('{"tests/a/test_slow.py": 90.0, "ray": 50.0, "tests/a/test_units.py": 2.0}')
    monkeypatch.setattr(conftest, "DURATIONS", durations)
    items = [
        FakeItem("tests/a/test_units.py::one"),
        FakeItem("tests/a/test_units.py::two"),
        FakeItem("tests/a/test_new.py::starts_an_engine", "vllm"),  # not measured yet: 40 s by its marker
        FakeItem("tests/launch/test_ray_x.py::t", "ray"),
        FakeItem("tests/a/test_slow.py::t", "integration"),
        FakeItem("tests/launch/test_ray_y.py::t", "ray"),
        FakeItem("tests/a/test_other_units.py::t"),  # not measured: 0.1 s
    ]
    ordered = [item.nodeid for item in conftest.costliest_scopes_first(items)]  # type: ignore[arg-type]
    assert ordered == [
        "tests/a/test_slow.py::t",
        "tests/launch/test_ray_x.py::t",  # the Ray unit together, its tests in their order
        "tests/launch/test_ray_y.py::t",
        "tests/a/test_new.py::starts_an_engine",
        "tests/a/test_units.py::one",
        "tests/a/test_units.py::two",
        "tests/a/test_other_units.py::t",
    ]
