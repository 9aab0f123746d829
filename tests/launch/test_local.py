"""`tandem run`'s report of a failing role: the exception's final line and where the full log is, not its tail."""

from __future__ import annotations

from pathlib import Path

from launch.local import Role, last_meaningful_line

CHAINED = """\
12:00:01 generator-0 INFO starting vLLM
Traceback (most recent call last):
  File "/x/actors/generator.py", line 40, in load
    return read(path)
           ^^^^^^^^^^
FileNotFoundError: [Errno 2] No such file or directory: 'model'

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/launch/cli.py", line 150, in main
    result = getattr(importlib.import_module(module), function)(config)
  File "/x/actors/generator.py", line 44, in load
    raise RuntimeError("the engine did not start:\\nsee above")
RuntimeError: the engine did not start:
see above

12:00:02 generator-0 INFO released the socket context
"""


def test_the_exception_line_of_the_last_traceback() -> None:
    assert last_meaningful_line(CHAINED) == "RuntimeError: the engine did not start:"


def test_a_prefixed_traceback_and_plain_output() -> None:
    engine = "\n".join(
        f"(EngineCore_DP0 pid=7) {line}"
        for line in [
            "Traceback (most recent call last):",
            '  File "/v/core.py", line 9, in run',
            "    step()",
            "ValueError: bad shape",
        ]
    )
    assert last_meaningful_line(f"INFO up\n{engine}\nINFO shutting down\n") == "ValueError: bad shape"
    assert last_meaningful_line("tandem: model.path: no such model directory 'x'\n\n") == (
        "tandem: model.path: no such model directory 'x'"
    )
    assert last_meaningful_line("") == last_meaningful_line("\n \n") == "(no output)"
    assert last_meaningful_line("Traceback (most recent call last):\n  File 'x', line 1\n") == "File 'x', line 1"


def test_the_failure_names_the_code_the_line_and_the_log(tmp_path: Path) -> None:
    role = Role("generator-0", ["true"], None, out_path=tmp_path / "generator-0.out")
    role.out_path.write_text(CHAINED)
    assert role.failure() == (
        f"generator-0 exited with code None: RuntimeError: the engine did not start:\n"
        f"  full log: {tmp_path / 'generator-0.out'}"
    )


def test_a_ray_members_failure_is_told_the_same_way(tmp_path: Path, monkeypatch) -> None:
    """`tandem ray` reports a failing member as `tandem run` does: its exception line (read through its actor's
    tail) and where its log is; an actor that is gone gives only where the log is."""
    from ray.exceptions import RayActorError

    from launch.ray import members as ray_members

    class Tail:
        def __init__(self, result: object) -> None:
            self.result = result

        def remote(self, lines: int) -> object:
            if isinstance(self.result, BaseException):
                raise self.result
            return self.result

    def member(result: object) -> ray_members.Member:
        actor = type("Actor", (), {"tail": Tail(result)})()
        return ray_members.Member("generator-3", "generator", 3, actor, slot=None, node={})  # type: ignore[arg-type]

    monkeypatch.setattr(ray_members, "call", lambda ref: ref)
    log = tmp_path / "logs" / "generator-3.out"
    assert ray_members.failure(member(CHAINED), tmp_path) == (
        f"RuntimeError: the engine did not start:\n  full log: {log}"
    )
    assert ray_members.failure(member(RayActorError()), tmp_path) == f"(actor gone)\n  full log: {log}"
