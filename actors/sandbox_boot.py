"""Bootstrap of a sandboxed Python process (`actors.sandbox`): isolate, limit, guard, then run the untrusted script.

    python -I -S actors/sandbox_boot.py ROOT SCRIPT LIMITS_JSON

Runs as the sandboxed process's first code, single-threaded, before any untrusted line:
  1. network: unshare(CLONE_NEWNET), a new network namespace with no interface but a down loopback (as root; else
     with a new user namespace when the kernel allows it);
  2. filesystem: unshare(CLONE_NEWNS), ROOT bind-mounted on itself, then `/` remounted read-only: only ROOT (and
     other separate mounts, e.g. /dev/shm) stay writable;
  3. resource limits: address space, CPU seconds, file size, open files, no core dumps;
  4. an audit hook (PEP 578) that refuses, whatever 1-2 achieved: socket creation; opening a file for writing, and
     creating, removing, renaming or re-permissioning a path, outside ROOT; subprocesses, exec, fork and ctypes
     (each could step around the hook);
  5. what was achieved is written to ROOT/.isolation.json (read by the parent), then SCRIPT runs as `__main__`.
Steps 1-2 are the boundary where the kernel grants them; the audit hook is a second layer (Python code that tampers
with interpreter internals could subvert it), and the only one where namespaces are unavailable.
Standard library only: it runs under `-I -S` (no site-packages, no environment variables honoured).
"""

import json
import os
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PATH_EVENTS = {  # audit event -> positions of its path arguments
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.rename": (0, 1),
    "os.link": (0, 1),
    "os.symlink": (1,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.truncate": (0,),
    "os.utime": (0,),
    "os.mknod": (0,),
    "os.mkfifo": (0,),
    "os.setxattr": (0,),
    "os.removexattr": (0,),
    "shutil.rmtree": (0,),
    "shutil.copyfile": (1,),
    "shutil.copytree": (1,),
    "shutil.move": (0, 1),
    "shutil.make_archive": (0,),
}
FORBIDDEN_EVENTS = {
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "os.forkpty",
    "ctypes.dlopen",
    "ctypes.dlsym",
    "ctypes.cdata",
    "socket.__new__",
    "socket.socketpair",
    "gc.get_referrers",
    "gc.get_referents",
    "gc.get_objects",
    "sys._current_frames",
}
FORBIDDEN_IMPORTS = {"ctypes", "_ctypes", "_posixsubprocess"}


def isolate(root):
    """Namespaces (steps 1-2); returns what was achieved."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
    except (ImportError, OSError):
        return {"network": "audit_hook", "filesystem": "audit_hook"}
    own_user = os.geteuid() != 0 and libc.unshare(CLONE_NEWUSER) == 0  # unprivileged: caps inside a user ns
    network = "netns" if libc.unshare(CLONE_NEWNET) == 0 else "audit_hook"
    filesystem = "audit_hook"
    if libc.unshare(CLONE_NEWNS) == 0:
        mount = libc.mount
        steps = (
            mount(None, b"/", None, MS_REC | MS_PRIVATE, None),  # nothing propagates back to the host
            mount(root.encode(), root.encode(), None, MS_BIND, None),  # ROOT: its own, writable, mount
            mount(None, b"/", None, MS_BIND | MS_REMOUNT | MS_RDONLY, None),
        )
        if all(step == 0 for step in steps):
            filesystem = "readonly_root"
        os.chdir(root)  # the working directory must be the new, writable mount, not the directory beneath it
    for name in [m for m in sys.modules if m == "ctypes" or m.startswith("ctypes.") or m == "_ctypes"]:
        del sys.modules[name]  # a later `import ctypes` goes through the import audit event again
    return {"network": network, "filesystem": filesystem, "user_namespace": str(own_user).lower()}


def limit(limits):
    import resource

    memory = int(limits["memory_mb"]) << 20
    cpu = max(1, int(limits["time_s"] + 1))
    for what, value in (
        (resource.RLIMIT_AS, memory),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_FSIZE, int(limits["file_size_mb"]) << 20),
        (resource.RLIMIT_NOFILE, int(limits["max_open_files"])),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(what, (value, value))


def guard(root):
    """Install the audit hook (step 4). It cannot be removed once added."""
    realpath, sep, join, getcwd, fspath = os.path.realpath, os.sep, os.path.join, os.getcwd, os.fspath

    def inside(path):
        if isinstance(path, int) or path is None:
            return True  # a file descriptor: opened (and checked) before
        path = fspath(path)
        if isinstance(path, bytes):
            path = path.decode(errors="surrogateescape")
        full = realpath(join(getcwd(), path))
        return full == root or full.startswith(root + sep)

    def hook(event, args):
        if event in FORBIDDEN_EVENTS:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].partition(".")[0] in FORBIDDEN_IMPORTS:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open" and args[2] is not None and args[2] & WRITE_FLAGS and not inside(args[0]):
            raise PermissionError(f"sandbox: writing {args[0]!r} outside the sandbox directory is not allowed")
        if event == "open" and isinstance(args[1], str) and set(args[1]) & set("wax+") and not inside(args[0]):
            raise PermissionError(f"sandbox: writing {args[0]!r} outside the sandbox directory is not allowed")
        for position in PATH_EVENTS.get(event, ()):
            if len(args) > position and not inside(args[position]):
                raise PermissionError(f"sandbox: {event} on {args[position]!r} outside the sandbox is not allowed")

    sys.addaudithook(hook)


def main():
    root, script, limits = os.path.realpath(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    isolation = isolate(root)
    with open(os.path.join(root, ".isolation.json"), "w") as file:
        json.dump(isolation, file)
    limit(limits)
    import runpy  # before the hook: the untrusted script gets a clean argv and its own globals

    sys.argv = [script]
    sys.path.insert(0, root)  # the script may import the files written beside it
    guard(root)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
