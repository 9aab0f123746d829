"""The sandbox escapes of issue 12, played as real code as root (how roles run here), each seen to FAIL.

Every escape runs twice where it matters: through the whole sandbox, and with the audit hook off
(`SandboxLimits(audit_hook=False)`), so that it is the kernel's isolation (namespaces, private root, nobody with no
capabilities, seccomp) that stops it, not the hook. After each attack the sandbox still serves a plain run.
Attacks that could take down the process calling `run_python` (kill, floods) run from a caller subprocess, so that
its survival and its peak memory are observed, not assumed.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from actors.environments.sandbox import SandboxLimits, run_python
from common.types import PromptItem
from examples.envs.code_task import CodeEnv

REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.integration,  # every attack runs in a real sandboxed subprocess
    pytest.mark.skipif(os.geteuid() != 0, reason="the escapes were found as root and are played as root"),
]
BOTH_LAYERS = pytest.mark.parametrize("audit_hook", [True, False], ids=["whole_sandbox", "kernel_alone"])


@pytest.fixture(autouse=True)
def still_serving():
    """After the attack, the sandbox runs a plain program as before."""
    yield
    result = run_python("print('still serving')")
    assert result.ok and result.stdout == "still serving\n", result.stderr


@pytest.fixture
def listener():
    """A TCP listener on the host's loopback: (port, connections accepted)."""
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    yield server.getsockname()[1], accepted
    server.close()


def outcome_of(result) -> dict:
    """The JSON line the attack printed last (each attack reports what every step of it met)."""
    lines = [line for line in result.stdout.splitlines() if line.startswith("OUTCOME ")]
    assert lines, f"the attack reported nothing: {result.stdout[-500:]} {result.stderr[-1500:]}"
    return json.loads(lines[-1][len("OUTCOME ") :])


def caller(code: str, timeout_s: float = 120) -> dict:
    """Run `code` in a fresh Python process (the process that calls run_python); its last stdout line is JSON."""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert result.returncode == 0, f"the caller died ({result.returncode}): {result.stderr[-2000:]}"
    return json.loads(result.stdout.splitlines()[-1])


# ------------------------------------------------------------------------------ subinterpreter, ctypes, setns
ESCAPE_IN_SUBINTERPRETER = """
import ctypes, errno, json, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
outcome = {{}}
for pid in ({caller_pid}, os.getppid(), 1):
    for kind in ("net", "mnt", "pid", "user"):
        path = f"/proc/{{pid}}/ns/{{kind}}"
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as error:
            outcome[path] = errno.errorcode.get(error.errno, type(error).__name__)
            continue
        outcome[path] = "JOINED" if libc.setns(fd, 0) == 0 else errno.errorcode.get(ctypes.get_errno(), 'unknown')
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    outcome["connect"] = "CONNECTED"
except OSError as error:
    outcome["connect"] = errno.errorcode.get(error.errno, str(error))
try:
    open({host_file!r}, "w").write("escaped")
    outcome["host_write"] = "WRITTEN"
except OSError as error:
    outcome["host_write"] = errno.errorcode.get(error.errno, type(error).__name__)
print("OUTCOME " + json.dumps(outcome))
sys.stdout.flush()
"""


@BOTH_LAYERS
def test_subinterpreter_ctypes_setns_to_the_parents_namespaces_fails(audit_hook, listener, tmp_path) -> None:
    port, accepted = listener
    host_file = tmp_path / "escaped.txt"
    inner = ESCAPE_IN_SUBINTERPRETER.format(caller_pid=os.getpid(), port=port, host_file=str(host_file))
    attack = f"""
import json
try:
    import _xxsubinterpreters as interpreters
except (ImportError, PermissionError) as error:  # the audit hook refuses with PermissionError
    print("OUTCOME " + json.dumps({{"subinterpreter": type(error).__name__}}))
    raise SystemExit(0)
interpreters.run_string(interpreters.create(), {inner!r})
"""
    result = run_python(attack, limits=SandboxLimits(audit_hook=audit_hook, time_s=20))
    outcome = outcome_of(result)
    if audit_hook:
        assert outcome == {"subinterpreter": "PermissionError"}
    else:  # the subinterpreter ran, ctypes loaded: the kernel is what stops the rest
        joins = {path: met for path, met in outcome.items() if path.startswith("/proc/")}
        assert joins and "JOINED" not in joins.values(), joins
        assert {joins[f"/proc/{os.getpid()}/ns/net"], joins["/proc/0/ns/net"]} == {"ENOENT"}  # not in its /proc
        assert joins["/proc/1/ns/net"] == "EPERM"  # its own namespace: no CAP_SYS_ADMIN, and seccomp says no
        assert outcome["connect"] == "ENETUNREACH" and outcome["host_write"] == "ENOENT"
    assert not accepted and not host_file.exists()


# ---------------------------------------------------------------------------------------------- /dev/shm
@BOTH_LAYERS
def test_dev_shm_staging_file_cannot_be_overwritten(audit_hook) -> None:
    """The generator stages vLLM weights in /dev/shm; the sandbox's /dev/shm is a private tmpfs."""
    name = f"tandem-staging-{secrets.token_hex(6)}"
    staged = Path("/dev/shm") / name
    staged.write_bytes(b"weights v1")
    try:
        attack = f"""
import errno, json, os
outcome = {{"listing_has_it": {name!r} in os.listdir("/dev/shm")}}
def via_dir_fd():
    directory = os.open("/dev/shm", os.O_RDONLY)
    os.write(os.open({name!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, dir_fd=directory), b"poisoned")
for how, attempt in (("dir_fd", via_dir_fd), ("path", lambda: open("/dev/shm/{name}", "wb").write(b"poisoned"))):
    try:
        attempt(); outcome[how] = "wrote"
    except OSError as error:
        outcome[how] = errno.errorcode.get(error.errno, type(error).__name__)
print("OUTCOME " + json.dumps(outcome))
"""
        outcome = outcome_of(run_python(attack, limits=SandboxLimits(audit_hook=audit_hook)))
        assert outcome["listing_has_it"] is False  # it sees its own, empty /dev/shm
        assert staged.read_bytes() == b"weights v1"  # whatever it wrote went to its private tmpfs
    finally:
        staged.unlink()


# ------------------------------------------------------------------------------------------- leaks and kills
@BOTH_LAYERS
def test_parent_environment_and_secret_key_file_cannot_be_read(audit_hook, tmp_path, monkeypatch) -> None:
    environment_secret, key_secret = secrets.token_hex(16), secrets.token_hex(16)
    monkeypatch.setenv("TANDEM_CURVE_SECRET", environment_secret)  # the process that calls run_python
    key_file = tmp_path / "generator.key_secret"
    key_file.write_text(f"secret-key = {key_secret}\n")
    key_file.chmod(0o600)
    attack = f"""
import errno, glob, json, os
outcome, seen = {{}}, []
paths = ["/proc/{os.getpid()}/environ", f"/proc/{{os.getppid()}}/environ", {str(key_file)!r}]
for path in paths + glob.glob("/proc/[0-9]*/environ"):
    try:
        seen.append(open(path, "rb").read().decode(errors="replace")); outcome[path] = "read"
    except OSError as error:
        outcome[path] = errno.errorcode.get(error.errno, type(error).__name__)
seen.append(repr(dict(os.environ)))
print("\\n".join(seen))
print("OUTCOME " + json.dumps(outcome))
"""
    result = run_python(attack, limits=SandboxLimits(audit_hook=audit_hook))
    outcome = outcome_of(result)
    assert environment_secret not in result.stdout and key_secret not in result.stdout
    assert outcome[f"/proc/{os.getpid()}/environ"] == "ENOENT" and outcome[str(key_file)] == "ENOENT"
    assert set(outcome) - {f"/proc/{os.getpid()}/environ", "/proc/0/environ", str(key_file)} <= {"/proc/1/environ"}


KILL_CALLER = """
import json, os, sys
from actors.environments.sandbox import SandboxLimits, run_python
attack = '''
import errno, json, os, signal
outcome = {}
for name, pid in (("caller", CALLER), ("unrelated", VICTIM), ("everyone", -1)):
    try:
        os.kill(pid, signal.SIGKILL); outcome[name] = "sent"
    except OSError as error:
        outcome[name] = errno.errorcode.get(error.errno, type(error).__name__)
print("OUTCOME " + json.dumps(outcome))
'''.replace("CALLER", str(os.getpid()))
reports = {}
for hook in (True, False):
    result = run_python(attack, limits=SandboxLimits(audit_hook=hook))
    reports[str(hook)] = [line for line in result.stdout.splitlines() if line.startswith("OUTCOME ")]
print(json.dumps({"caller_alive": True, "reports": reports}))
"""


def test_os_kill_of_the_parent_and_of_an_unrelated_process_fails() -> None:
    victim = subprocess.Popen(["sleep", "120"])
    try:
        answer = caller(KILL_CALLER.replace("VICTIM", str(victim.pid)))
        assert answer["caller_alive"] and victim.poll() is None
        with_hook = json.loads(answer["reports"]["True"][0][len("OUTCOME ") :])
        kernel_alone = json.loads(answer["reports"]["False"][0][len("OUTCOME ") :])
        assert set(with_hook.values()) == {"PermissionError"}  # the hook refuses os.kill
        # its PID namespace holds itself alone: the others do not exist there; kill(-1) spares the caller
        assert kernel_alone["caller"] == kernel_alone["unrelated"] == "ESRCH"
    finally:
        victim.kill()
        victim.wait()


# ------------------------------------------------------------------------------------------------- floods
FLOOD_CALLER = """
import json, resource
from actors.environments.sandbox import SandboxLimits, run_python
run_python("pass")  # imports and first allocations done before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, peak so far
flood = "import os\\nchunk = b'x' * (1 << 20)\\nfor _ in range(1536):\\n    os.write(1, chunk)\\n"  # 1.5 GB
result = run_python(flood, limits=SandboxLimits(time_s=60))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"before_kib": before, "after_kib": after, "exceeded": result.output_exceeded,
                  "returncode": result.returncode, "kept": len(result.stdout), "seconds": result.seconds}))
"""


def test_stdout_flood_keeps_the_callers_memory_bounded() -> None:
    """1.5 GB of stdout once took the caller to a 4.5 GB peak; now it is killed at output_bytes (1 MiB)."""
    answer = caller(FLOOD_CALLER)
    assert answer["exceeded"] and answer["returncode"] is None and answer["kept"] <= 1 << 20
    # bound: the 1 MiB kept as bytes, one 64 KiB read beyond it, the decoded 1 MiB str, plus allocator slack
    growth_mib = (answer["after_kib"] - answer["before_kib"]) / 1024
    assert growth_mib < 16, answer
    assert answer["seconds"] < 30, answer  # killed at the cap, long before 1.5 GB or the time limit


@BOTH_LAYERS
def test_disk_flood_is_capped(audit_hook) -> None:
    """It once wrote 2.7 GB in 4.5 s; now its directory, /tmp and /dev/shm share one disk_mb tmpfs."""
    disk_mb = 16
    attack = """
import errno, json, os
written, errors = 0, {}
for where in (".", "/tmp", "/dev/shm"):
    for index in range(1000):
        try:
            with open(f"{where}/flood{index}", "wb", buffering=0) as file:
                for _ in range(4):
                    file.write(b"\\0" * (1 << 20))
                    written += 1 << 20
        except OSError as error:
            errors[where] = errno.errorcode.get(error.errno, type(error).__name__)
            break
print("OUTCOME " + json.dumps({"written": written, "errors": errors}))
"""
    result = run_python(attack, limits=SandboxLimits(disk_mb=disk_mb, audit_hook=audit_hook, time_s=30))
    outcome = outcome_of(result)
    assert result.ok, result.stderr
    refused = "PermissionError" if audit_hook else "ENOSPC"  # the hook refuses writes outside its directory
    assert outcome["errors"] == {".": "ENOSPC", "/tmp": refused, "/dev/shm": refused}
    # at most the cap; at least the cap less the directory's own files and tmpfs rounding (a few pages, < 1 MiB)
    assert (disk_mb - 1) << 20 <= outcome["written"] <= disk_mb << 20


# -------------------------------------------------------------------------------------- the code-task hack
GCD_CASES = json.dumps([[[12, 18], 6], [[7, 0], 7], [[0, 0], 0]])
FORGERIES = {
    "empty_report": "print(__main__.MARKER + json.dumps({'outputs': []}), flush=True)",
    "short_report": "print(__main__.MARKER + json.dumps({'outputs': [{'value': 6}]}), flush=True)",
    "long_report": "print(__main__.MARKER + json.dumps({'outputs': [{'value': 6}] * 4}), flush=True)",
    "extra_keys": "print(__main__.MARKER + json.dumps({'outputs': [{'value': 6, 'error': ''}] * 3, 'ok': 1}))",
    "garbled": "print(__main__.MARKER + '{not json', flush=True)",
    "answer_key": f"print(open({str(REPO / 'examples/envs/data/code.jsonl')!r}).read()[:10], flush=True)",
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_code_task_forged_report_scores_zero(forgery: str) -> None:
    """The solution reads the harness's marker from __main__, prints a report of its own and exits before the
    harness can: its function is wrong (returns 0), so whatever it prints it scores 0."""
    solution = f"import __main__, json, os\n{FORGERIES[forgery]}\nos._exit(0)\ndef gcd(a, b):\n    return 0\n"
    env = CodeEnv(max_attempts=1, time_limit_s=5)
    env.reset(PromptItem(0, 0, [{"role": "user", "content": "gcd"}], {"function": "gcd", "cases": GCD_CASES}))
    result = env.step(f"```python\n{solution}```")
    assert result.done and result.reward == 0.0 and result.info == {"passed": 0}
