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
