"""The sandbox (actors/environments/sandbox.py): no network, no writes outside its directory, time, memory and output limits,
no secrets, and a clear refusal where the kernel grants no isolation.

Each check runs real untrusted-looking code in a real subprocess. The kernel layers (namespaces, private root,
seccomp, no capabilities) are also tested alone, without the audit hook. The escapes found as root are played in
tests/security/test_sandbox_escapes.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from actors.environments.sandbox import BOOT, SandboxLimits, run_python

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


def python_under(prefix: list[str], code: str) -> object:
    """Run `code` with this interpreter under the command `prefix` (e.g. `unshare --user`) from the repository root;
    the JSON it printed."""
    result = subprocess.run(
        [*prefix, sys.executable, "-c", code],
        cwd=BOOT.parents[1],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


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


def test_kernel_layers_alone_without_the_audit_hook(tmp_path, listening_port) -> None:
    """With the audit hook off, what the kernel grants holds by itself: no route, `/` read-only and the host's
    paths absent, no fork or exec (seccomp), nobody with no capabilities."""
    port, accepted = listening_port
    outside = tmp_path / "outside.txt"
    code = f"""
import ctypes, errno, json, os, socket
outcome = {{"ctypes": "ALLOWED"}}  # the hook would have refused the import: it is off
for name, attempt in (
    ("connect", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2)),
    ("outside", lambda: open({str(outside)!r}, "w")),
    ("root", lambda: open("/usr/tandem-probe", "w")),
    ("fork", os.fork),
    ("exec", lambda: os.execv("/bin/true", ["true"])),
    ("unshare", lambda: ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0 or os.strerror(ctypes.get_errno())),
):
    try:
        met = attempt()  # a string: the errno text of a libc call that failed
        outcome[name] = met if isinstance(met, str) else "ALLOWED"
    except OSError as error:
        outcome[name] = errno.errorcode[error.errno]
open("inside.txt", "w").write("fine"); outcome["inside"] = "ALLOWED"
print(json.dumps(outcome))
"""
    result = run_python(code, limits=SandboxLimits(audit_hook=False))
    assert result.ok, result.stderr
    assert json.loads(result.stdout) == {
        "ctypes": "ALLOWED",
        "connect": "ENETUNREACH",  # no interface is up in the new network namespace, not even loopback
        "outside": "ENOENT",  # the host's directories do not exist in the private root
        "root": "EROFS",
        "fork": "EPERM",  # seccomp
        "exec": "EPERM",
        "unshare": "Operation not permitted",  # a new user namespace: seccomp
        "inside": "ALLOWED",
    }
    assert not accepted and not outside.exists()
    granted = result.isolation
    assert granted["mode"] == "namespaces" and granted["audit_hook"] == "off" and granted["nonewprivs"] == "1"
    assert {granted[key] for key in ("capinh", "capprm", "capeff", "capbnd", "capamb")} == {"0" * 16}
    assert granted["uid"].split()[0] == ("65534" if os.geteuid() == 0 else "0")  # 0: of its own user namespace


def test_output_beyond_the_cap_kills_the_process_and_says_so() -> None:
    cap = 64 * 1024
    flood = "import os\nwhile True:\n    os.write(1, b'x' * 4096)\n    os.write(2, b'y' * 4096)\n"
    result = run_python(flood, limits=SandboxLimits(output_bytes=cap, time_s=20))
    assert result.output_exceeded and result.returncode is None and not result.ok and not result.timed_out
    assert len(result.stdout) + len(result.stderr) <= cap
    assert result.seconds < 10  # killed at the cap, not at the time limit


def test_stdin_is_fed_whole_and_large_output_under_the_cap_comes_back() -> None:
    data = "".join(f"{i}\n" for i in range(200_000))  # ~1.3 MB: more than a pipe holds, fed as it is read
    code = "import sys\nlines = sys.stdin.read().splitlines()\nprint(len(lines), lines[-1])\nprint('z' * 500_000)"
    result = run_python(code, stdin=data, limits=SandboxLimits(time_s=20))
    assert result.ok, result.stderr
    first, rest = result.stdout.split("\n", 1)
    assert first == "200000 199999" and rest == "z" * 500_000 + "\n"


def test_concurrent_runs_from_many_threads_stay_apart() -> None:
    """Thread-safe (no preexec_fn); each run sees only its own files in its own private directory."""
    results: dict[int, object] = {}

    def one(index: int) -> None:
        results[index] = run_python(
            "import os\nprint(open('mine.txt').read(), sorted(os.listdir('/tmp')).__len__())",
            files={"mine.txt": f"run-{index}"},
            limits=SandboxLimits(time_s=30),
        )

    threads = [threading.Thread(target=one, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, result in results.items():
        assert result.ok, result.stderr
        assert result.stdout.split() == [f"run-{index}", "2"]  # /tmp holds its directory and the private shm only


def test_exit_status_and_traceback_as_the_interpreter_gives_them() -> None:
    assert run_python("import sys\nsys.exit(3)").returncode == 3
    failed = run_python("raise ValueError('boom')")
    assert failed.returncode == 1 and failed.stderr.splitlines()[-1] == "ValueError: boom"
    assert "sandbox_boot" not in failed.stderr  # the traceback starts at the script
    threaded = run_python(
        "import threading, atexit\natexit.register(print, 'at exit')\n"
        "threading.Thread(target=print, args=('thread',)).start()"
    )
    assert threaded.ok and threaded.stdout == "thread\nat exit\n"


def test_without_namespaces_it_refuses_unless_opted_in() -> None:
    """A user namespace with no uid mapping stands for a kernel that grants nothing: the sandbox refuses, naming
    the opt-in, and runs with the audit hook alone (still no capabilities) only when asked to."""
    if subprocess.run(["unshare", "--user", "true"], check=False, capture_output=True).returncode != 0:
        pytest.skip("unshare --user is not permitted here")
    code = """
import json, sys
from actors.environments.sandbox import SandboxLimits, SandboxUnavailable, run_python
try:
    run_python("print(1)")
    refused = None
except SandboxUnavailable as error:
    refused = str(error)
opted = run_python("print(open('/etc/hostname').read() != '')", limits=SandboxLimits(allow_audit_hook_only=True))
print(json.dumps({"refused": refused, "stdout": opted.stdout, "isolation": opted.isolation}))
"""
    outcome = python_under(["unshare", "--user"], code)
    assert "the kernel granted no namespaces" in outcome["refused"]
    assert "SandboxLimits(allow_audit_hook_only=True)" in outcome["refused"]
    assert outcome["stdout"] == "True\n"  # the host's files are visible in that mode: it is the weaker one
    assert outcome["isolation"]["mode"] == "audit_hook_only" and outcome["isolation"]["capeff"] == "0" * 16


def test_audit_hook_only_mode_as_root_still_drops_to_nobody() -> None:
    """The opted-in weaker mode (played directly: as root the kernel grants namespaces, so run_python would not
    fall back): no namespaces, but nobody with no capabilities, seccomp and the hook; or, where nobody could not
    even load the standard library (an interpreter under /root), a refusal that says so."""
    if os.geteuid() != 0:
        pytest.skip("the drop to nobody is what root does in that mode")
    from actors.environments.sandbox import _run_boot, _write_files

    prefix = Path(sys.base_prefix).resolve()
    closed = any(not parent.stat().st_mode & 0o001 for parent in prefix.parents)

    with tempfile.TemporaryDirectory(prefix="tandem-sandbox-") as directory:  # as run_python makes it
        root = Path(directory)
        _write_files(root / "files", {"main.py": "import os\nprint(os.getuid(), open('own.txt', 'w').write('x'))"})
        result = _run_boot(root, SandboxLimits(allow_audit_hook_only=True), "audit_hook_only", "")
    if closed:
        assert "out of reach of uid 65534" in result.isolation["error"] and result.stdout == ""
        return
    assert result.ok and result.stdout == "65534 1\n", result.stderr
    granted = result.isolation
    assert granted["mode"] == "audit_hook_only" and granted["capeff"] == granted["capbnd"] == "0" * 16
    assert granted["seccomp_mode"] == "2" and granted["nonewprivs"] == "1"


def test_in_a_user_namespace_it_confines_without_root() -> None:
    """A caller that is not root (uid 1000 of a user namespace here) gets the same namespaces through a user
    namespace of its own: uid 0 there, which maps to the caller's uid, with no capabilities."""
    command = ["unshare", "--user", "--map-user=1000", "--map-group=1000"]
    if subprocess.run([*command, "true"], check=False, capture_output=True).returncode != 0:
        pytest.skip("unshare --user --map-user is not permitted here")
    code = "import json\nfrom actors.environments.sandbox import run_python\nr = run_python('print(1)')\n"
    code += "print(json.dumps([r.stdout, r.isolation]))"
    stdout, granted = python_under(command, code)
    assert stdout == "1\n" and granted["mode"] == "namespaces" and granted["namespaces"].endswith(",user")
    assert granted["uid"].split()[0] == "0" and granted["capeff"] == granted["capbnd"] == "0" * 16


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="SandboxLimits.disk_mb must be a positive number"):
        SandboxLimits(disk_mb=0)
    with pytest.raises(ValueError, match="more than SandboxLimits.disk_mb=1"):
        run_python("pass", files={"big.txt": "x" * (2 << 20)}, limits=SandboxLimits(disk_mb=1))
