"""The sandbox (actors/sandbox.py): no network, no writes outside its directory, time and memory limits, no secrets.

Each check runs real untrusted-looking code in a real subprocess. The kernel layers (network namespace, read-only
root) are also tested alone, without the audit hook, where this machine grants them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest

from actors.sandbox import BOOT, SandboxLimits, run_python

pytestmark = pytest.mark.integration  # every check runs code in a real subprocess

PROBE = """
import os, sys
for name, attempt in {attempts}:
    try:
        attempt()
        print(name, "ALLOWED")
    except Exception as error:
        print(name, "refused", type(error).__name__)
"""


def probe(attempts: str, **limits) -> dict[str, str]:
    result = run_python(PROBE.format(attempts=attempts), limits=SandboxLimits(**limits))
    assert result.returncode == 0, result.stderr
    return {line.split()[0]: line.split()[1] for line in result.stdout.splitlines()}


@pytest.fixture
def listening_port():
    """A real TCP server on loopback that the sandbox must not reach."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted = []
    thread = threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    server.close()


def test_network_is_refused(listening_port) -> None:
    port, accepted = listening_port
    outcome = probe(f"""[
        ("connect", lambda: __import__("socket").create_connection(("127.0.0.1", {port}), timeout=2)),
        ("dns", lambda: __import__("socket").getaddrinfo("example.com", 80)),
        ("urllib", lambda: __import__("urllib.request").request.urlopen("http://127.0.0.1:{port}", timeout=2)),
    ]""")
    assert outcome == {"connect": "refused", "dns": "refused", "urllib": "refused"}
    assert not accepted


def test_writes_outside_the_directory_are_refused(tmp_path) -> None:
    outside = tmp_path / "outside.txt"
    outcome = probe(f"""[
        ("inside", lambda: open("inside.txt", "w").write("fine")),
        ("nested", lambda: (os.makedirs("a/b"), open("a/b/c.txt", "w").write("fine"))),
        ("outside", lambda: open({str(outside)!r}, "w").write("escape")),
        ("append", lambda: open("/etc/hostname", "a")),
        ("symlink", lambda: (os.symlink({str(outside)!r}, "link"), open("link", "w").write("escape"))),
        ("remove", lambda: os.remove({str(tmp_path / "victim")!r})),
        ("rename", lambda: os.rename("inside.txt", {str(tmp_path / "moved")!r})),
        ("mkdir", lambda: os.mkdir({str(tmp_path / "made")!r})),
        ("subprocess", lambda: __import__("subprocess").run(["touch", {str(outside)!r}])),
        ("system", lambda: os.system("touch " + {str(outside)!r})),
        ("fork", lambda: os.fork()),
        ("ctypes", lambda: __import__("ctypes")),
    ]""")
    assert outcome.pop("inside") == outcome.pop("nested") == "ALLOWED"
    assert set(outcome.values()) == {"refused"}, outcome
    (tmp_path / "victim").write_text("still here")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim"]


def test_time_limit_kills_a_busy_loop_and_its_children() -> None:
    result = run_python("while True:\n    pass\n", limits=SandboxLimits(time_s=1.0))
    assert result.timed_out and result.returncode is None and not result.ok
    assert 0.9 < result.seconds < 5


def test_memory_limit_stops_a_large_allocation() -> None:
    result = run_python("blob = bytearray(1 << 31)\nprint('allocated')", limits=SandboxLimits(memory_mb=256))
    assert result.returncode != 0 and "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_no_inherited_environment_and_a_private_directory(monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_TEST_SECRET", "hunter2")
    result = run_python(
        "import os, json\nprint(json.dumps([dict(os.environ), os.getcwd(), sorted(os.listdir())]))",
        files={"helper.py": "X = 1\n"},
    )
    environment, cwd, listing = json.loads(result.stdout)
    assert set(environment) == {"PATH", "HOME", "LANG"} and environment["HOME"] == cwd
    assert "hunter2" not in result.stdout and "tandem-sandbox-" in cwd
    assert "helper.py" in listing and "main.py" in listing
    assert not os.path.exists(cwd)  # deleted afterwards


def test_kernel_layers_alone_without_the_audit_hook(tmp_path) -> None:
    """isolate() only (no hook): the network namespace has no route, and `/` is read-only but the directory."""
    root = tmp_path / "box"
    root.mkdir()
    code = f"""
import json, os, socket, sys
sys.path.insert(0, {str(BOOT.parent)!r})
from sandbox_boot import isolate
granted = isolate({str(root)!r})
outcome = {{"granted": granted}}
try:
    socket.create_connection(("127.0.0.1", 9), timeout=2); outcome["connect"] = "ALLOWED"
except OSError as error:
    outcome["connect"] = error.errno
for name, path in (("inside", "inside.txt"), ("outside", {str(tmp_path / "outside.txt")!r})):
    try:
        open(path, "w").write("x"); outcome[name] = "ALLOWED"
    except OSError as error:
        outcome[name] = error.errno
print(json.dumps(outcome))
"""
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], cwd=root, capture_output=True, text=True, timeout=60, check=False
    )
    outcome = json.loads(result.stdout)
    granted = outcome["granted"]
    if granted["network"] != "netns" and granted["filesystem"] != "readonly_root":
        pytest.skip(f"this machine grants no namespaces: {granted}")
    import errno

    if granted["network"] == "netns":
        assert outcome["connect"] == errno.ENETUNREACH  # no interface is up: not even loopback
    if granted["filesystem"] == "readonly_root":
        assert outcome["inside"] == "ALLOWED" and outcome["outside"] == errno.EROFS
        assert not (tmp_path / "outside.txt").exists()
