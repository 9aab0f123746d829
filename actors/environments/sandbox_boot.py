"""Bootstrap of a sandboxed Python process (`actors.environments.sandbox`): confine, limit, guard, then run the untrusted script.

    python -I -S actors/environments/sandbox_boot.py DIRECTORY NAME=VALUE...

DIRECTORY (made by the parent) holds `files/` (the script `main.py` and the files beside it), an empty `mnt/`, and
receives `isolation`: what was granted, or error=why, one `key=value` a line, written before the first untrusted
line runs. The options: the `SandboxLimits` fields (booleans as 1/0) plus mode=namespaces or mode=audit_hook_only.
(No json: importing it and `re` would cost ~10 ms a run.)

Mode "namespaces" (the default; needs root, or unprivileged user namespaces):
  1. this process unshares the mount, PID, network, IPC, UTS and cgroup namespaces (and a user namespace when it
     is not root), then forks: the child is PID 1 of the new PID namespace, in a session of its own; this process
     only waits for it and exits with its status (by the same signal if it was killed). When this process dies
     (the parent kills it at a limit), the kernel kills the child (PR_SET_PDEATHSIG), and with PID 1 every
     process of the namespace.
  2. the child builds a new root on a tmpfs: /usr, /bin, /lib*, and the interpreter's prefix bound read-only (no
     other host path exists in it: not the repository, not /root, /etc, /home, /run, /sys, nor another process's
     /proc); a fresh /proc of the new PID namespace; /dev with null, zero, full, random and urandom only; one
     size-capped tmpfs (`disk_mb`) holding the working directory /tmp/<name>, /tmp and a private /dev/shm;
     pivot_root into it, the old root detached, `/` read-only. The network namespace has only a down loopback.
  3. it drops privileges: the capability bounding set and ambient set emptied, uid/gid 65534 (nobody) with no
     supplementary groups when it was root (in a user namespace it stays the namespace's uid 0, which maps to the
     caller's own unprivileged uid), every capability cleared (capset), PR_SET_NO_NEW_PRIVS;
  4. seccomp (x86-64): setns, unshare, mount, pivot_root, ptrace, bpf, keyctl, perf_event_open, module loading,
     exec, fork (a clone without CLONE_THREAD, or with any namespace flag) and their kin fail with EPERM;
  5. resource limits: address space, CPU seconds, file size, open files, no core dumps;
  6. the audit hook (PEP 578), defence in depth only: it refuses sockets, writes outside the working directory,
     subprocesses, exec, fork, signals to other processes, ctypes and subinterpreters. It cannot see `dir_fd`
     arguments, and code that tampers with interpreter internals may step around it: steps 1-4 are the boundary.
Any failure in steps 1-4 reports error=... and exits 70 before untrusted code runs; the parent then refuses (or,
where the caller opted in, reruns in the next mode).

Mode "audit_hook_only" (explicit opt-in only): no namespaces, the working directory is DIRECTORY/files on the host
disk; as root it still drops to 65534 with no capabilities and no new privileges (and refuses, error=..., where
nobody could not reach the interpreter's standard library or DIRECTORY); then steps 4-6.
Standard library only: it runs under `-I -S` (no site-packages, no environment variables honoured).
"""

import os
import select
import signal
import sys
from types import MappingProxyType

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x02000000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_THREAD = 0x10000
NAMESPACES = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_CAP_AMBIENT = 1, 24, 38, 22, 47
PR_CAP_AMBIENT_CLEAR_ALL, SECCOMP_MODE_FILTER, LINUX_CAPABILITY_VERSION_3 = 4, 2, 0x20080522
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
NOBODY = 65534
SETUP_FAILED = 70  # exit status when confinement failed (the reason is in DIRECTORY/isolation)
HOST_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")  # a symlink stays a symlink
DEVICES = ("null", "zero", "full", "random", "urandom")
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
    "os.kill",
    "os.killpg",
    "os.setns",
    "os.unshare",
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
FORBIDDEN_IMPORTS = {  # each can step around the hook: raw memory, a subinterpreter without it, a test C-API
    "ctypes",
    "_ctypes",
    "_posixsubprocess",
    "_xxsubinterpreters",
    "_xxinterpchannels",
    "_xxinterpqueues",
    "_interpreters",
    "_interpchannels",
    "_interpqueues",
    "_testcapi",
    "_testinternalcapi",
    "_testmultiphase",
    "_testsinglephase",
    "_testbuffer",
    "_testimportmultiple",
    "_ctypes_test",
    "_xxtestfuzz",
}
SECCOMP_DENIED_X86_64 = {  # name -> number; each fails with EPERM
    "fork": 57, "vfork": 58, "execve": 59, "execveat": 322, "ptrace": 101, "syslog": 103, "uselib": 134,
    "personality": 135, "pivot_root": 155, "chroot": 161, "acct": 163, "settimeofday": 164, "mount": 165,
    "umount2": 166, "swapon": 167, "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171,
    "iopl": 172, "ioperm": 173, "init_module": 175, "delete_module": 176, "quotactl": 179, "clock_settime": 227,
    "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310,
    "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "kexec_file_load": 320, "bpf": 321,
    "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428,
    "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "pidfd_getfd": 438,
    "mount_setattr": 442,
}  # fmt: skip
SYS_CLONE_X86_64, SYS_CLONE3_X86_64, AUDIT_ARCH_X86_64, X32_SYSCALL_BIT = 56, 435, 0xC000003E, 0x40000000


class SetupFailed(Exception):
    """A confinement step failed: nothing untrusted has run; the reason goes to DIRECTORY/isolation."""


# ------------------------------------------------------------------------------------------------ kernel calls
def load_libc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ulong, text = ctypes.c_ulong, ctypes.c_char_p
    libc.mount.argtypes = [text, text, text, ulong, text]
    libc.umount2.argtypes = [text, ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ulong, ulong, ulong, ulong]
    libc.syscall.restype = ctypes.c_long
    return libc


def checked(result, what):
    """Raise SetupFailed naming `what` and errno when a libc call returned non-zero."""
    if result != 0:
        import ctypes

        number = ctypes.get_errno()
        raise SetupFailed(f"{what}: {os.strerror(number)} (errno {number})")


def _bytes(value):
    return value.encode() if isinstance(value, str) else value


def mount(libc, source, target, fstype, flags, data=None):
    what = f"mount {source or fstype or ''} on {target}"
    checked(libc.mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data)), what)


def bind_read_only(libc, source, target):
    mount(libc, source, target, None, MS_BIND | MS_REC)
    mount(libc, None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def write_report(report, entries):
    """`key=value` lines to the parent (one line each: a newline in a value becomes a space)."""
    os.write(report, "".join(f"{key}={str(value).replace(chr(10), ' ')}\n" for key, value in entries.items()).encode())


def write_file(path, text):
    with open(path, "w") as file:
        file.write(text)


# --------------------------------------------------------------------------------------------- the namespaces
def enter_namespaces(libc):
    """Unshare every namespace (step 1); returns whether a user namespace was needed (not root)."""
    own_user = os.geteuid() != 0
    uid, gid = os.geteuid(), os.getegid()
    checked(libc.unshare(NAMESPACES | (CLONE_NEWUSER if own_user else 0)), "unshare of the namespaces")
    if own_user:  # map the caller's uid and gid to 0 inside: the capabilities hold in the new namespaces only
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"0 {uid} 1")
        write_file("/proc/self/gid_map", f"0 {gid} 1")
    return own_user


def build_root(libc, directory, options, owner):
    """The new root on a tmpfs (step 2, before pivot_root); returns the working directory's path inside it."""
    new_root = os.path.join(directory, "mnt")
    mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing propagates back to the host
    mount(libc, "tandem-root", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=512,mode=755")

    def inside(path):  # a host-absolute path, placed under the new root
        return new_root + path

    for tree in HOST_TREES:
        if os.path.islink(tree):
            os.symlink(os.readlink(tree), inside(tree))
        elif os.path.isdir(tree):
            os.makedirs(inside(tree))
            bind_read_only(libc, tree, inside(tree))
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == tree or prefix.startswith(tree + "/") for tree in HOST_TREES):
        os.makedirs(inside(prefix))
        bind_read_only(libc, prefix, inside(prefix))
    os.makedirs(inside("/proc"))
    mount(libc, "proc", inside("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace's only
    os.makedirs(inside("/dev"))
    mount(libc, "tandem-dev", inside("/dev"), "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=755")
    for device in DEVICES:
        open(inside("/dev/" + device), "w").close()
        mount(libc, "/dev/" + device, inside("/dev/" + device), None, MS_BIND)
    for name, target in (("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")):
        os.symlink("/proc/self/fd" + target, inside("/dev/" + name))
    scratch = f"size={int(options['disk_mb'])}m,nr_inodes=4096,mode=1777"
    os.makedirs(inside("/tmp"))
    mount(libc, "tandem-scratch", inside("/tmp"), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, scratch)
    os.makedirs(inside("/tmp/.shm"), mode=0o1777)
    os.chmod(inside("/tmp/.shm"), 0o1777)
    os.makedirs(inside("/dev/shm"))
    mount(libc, inside("/tmp/.shm"), inside("/dev/shm"), None, MS_BIND)  # the same capped tmpfs
    work = "/tmp/" + os.path.basename(directory)
    copy_tree(os.path.join(directory, "files"), inside(work), owner)
    return new_root, work


def copy_tree(source, target, owner):
    """Copy the parent's files into the capped tmpfs, owned by the sandbox's user (ENOSPC past `disk_mb`)."""
    for folder, _, names in os.walk(source):
        destination = os.path.join(target, os.path.relpath(folder, source))
        os.makedirs(destination, exist_ok=True)
        os.chown(destination, owner, owner)
        for name in names:
            with open(os.path.join(folder, name), "rb") as reader, open(os.path.join(destination, name), "wb") as out:
                out.write(reader.read())
            os.chown(os.path.join(destination, name), owner, owner)
    os.chmod(target, 0o700)


def pivot(libc, new_root):
    """pivot_root into `new_root`, detach the old root, make `/` read-only (end of step 2)."""
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise SetupFailed(f"pivot_root: unknown syscall number on {os.uname().machine}")
    os.chdir(new_root)
    checked(libc.syscall(number, b".", b"."), "pivot_root")  # the old root is now stacked on the new one
    checked(libc.umount2(b".", MNT_DETACH), "detach of the old root")
    os.chdir("/")
    mount(libc, None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


# ------------------------------------------------------------------------------------------------- privileges
def drop_privileges(libc, to_nobody):
    """Step 3: no capability in any set, no new privileges; uid/gid 65534 when `to_nobody`."""
    import ctypes

    for capability in range(64):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            if ctypes.get_errno() == 22:  # EINVAL: past the kernel's last capability
                break
            if ctypes.get_errno() == 1 and granted_status()["capeff"].strip("0") == "":
                break  # EPERM with no capability at all: unprivileged, and NO_NEW_PRIVS bars any later gain
            checked(-1, f"drop of capability {capability} from the bounding set")
    checked(libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear of the ambient capabilities")
    if to_nobody:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (two 32-bit words each): all zero
    checked(libc.capset(header, data), "capset to no capabilities")
    checked(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")


def seccomp_program():
    """Step 4's BPF program (x86-64): (code, jt, jf, k) rows; a foreign architecture or x32 is killed/denied."""
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill, deny, absent = 0x7FFF0000, 0x80000000, 0x00050000 | 1, 0x00050000 | 38  # EPERM, ENOSYS
    rows = [(load, 0, 0, 4), (jeq, 1, 0, AUDIT_ARCH_X86_64), (ret, 0, 0, kill), (load, 0, 0, 0)]
    rows += [(jge, 0, 1, X32_SYSCALL_BIT), (ret, 0, 0, deny)]
    rows += [(jeq, 0, 1, SYS_CLONE3_X86_64), (ret, 0, 0, absent)]  # glibc falls back to clone, checked below
    rows += [
        (jeq, 0, 5, SYS_CLONE_X86_64),
        (load, 0, 0, 16),  # the low 32 bits of clone's flags
        (jset, 0, 2, CLONE_THREAD),  # not a thread: a fork
        (jset, 1, 0, NAMESPACES | CLONE_NEWUSER),  # (clone cannot make a time namespace: clone3 and unshare only)
        (ret, 0, 0, allow),
        (ret, 0, 0, deny),
    ]  # fmt: skip
    for number in sorted(SECCOMP_DENIED_X86_64.values()):
        rows += [(jeq, 0, 1, number), (ret, 0, 0, deny)]
    return rows + [(ret, 0, 0, allow)]


def install_seccomp(libc):
    """Step 4 (after PR_SET_NO_NEW_PRIVS); returns what was installed."""
    import ctypes

    if os.uname().machine != "x86_64":
        return f"unavailable on {os.uname().machine}"

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Filter))]

    rows = seccomp_program()
    filters = (Filter * len(rows))(*[Filter(*row) for row in rows])
    program = Program(len(rows), filters)
    checked(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(program), 0, 0), "seccomp filter")
    return "filter"


def die_with(libc, alive):
    """PR_SET_PDEATHSIG (set after the uid change, which clears it), then make sure the waiter still lives."""
    checked(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
    if select.select([alive], [], [], 0)[0]:  # its end of the pipe closed: it died before the line above
        os._exit(SETUP_FAILED)
    os.close(alive)


def granted_status():
    """What the kernel says this process now holds (from /proc/self/status)."""
    with open("/proc/self/status") as file:
        fields = dict(line.rstrip("\n").split(":\t", 1) for line in file if ":\t" in line)
    keys = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp")
    names = {key: "seccomp_mode" if key == "Seccomp" else key.lower() for key in keys}
    return {names[key]: " ".join(fields.get(key, "?").split()) for key in keys}


# ------------------------------------------------------------------------------------------- the untrusted run
def limit(options):
    import resource

    cpu = max(1, int(float(options["time_s"]) + 1))
    for what, value in (
        (resource.RLIMIT_AS, int(options["memory_mb"]) << 20),
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_FSIZE, int(options["file_size_mb"]) << 20),
        (resource.RLIMIT_NOFILE, int(options["max_open_files"])),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(what, (value, value))


def guard(root):
    """Install the audit hook (step 6, defence in depth). It cannot be removed once added."""
    realpath, sep, join, getcwd, fspath = os.path.realpath, os.sep, os.path.join, os.getcwd, os.fspath
    # closed over as frozensets: the script can reach this module's globals through frames, not these
    forbidden_events, forbidden_imports = frozenset(FORBIDDEN_EVENTS), frozenset(FORBIDDEN_IMPORTS)
    path_events, write_flags = MappingProxyType(dict(PATH_EVENTS)), WRITE_FLAGS

    def inside(path):
        if isinstance(path, int) or path is None:
            return True  # a file descriptor: opened (and checked) before
        path = fspath(path)
        if isinstance(path, bytes):
            path = path.decode(errors="surrogateescape")
        full = realpath(join(getcwd(), path))
        return full == root or full.startswith(root + sep)

    def hook(event, args):
        if event in forbidden_events:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].partition(".")[0] in forbidden_imports:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open" and args[2] is not None and args[2] & write_flags and not inside(args[0]):
            raise PermissionError(f"sandbox: writing {args[0]!r} outside the sandbox directory is not allowed")
        if event == "open" and isinstance(args[1], str) and set(args[1]) & set("wax+") and not inside(args[0]):
            raise PermissionError(f"sandbox: writing {args[0]!r} outside the sandbox directory is not allowed")
        for position in path_events.get(event, ()):
            if len(args) > position and not inside(args[position]):
                raise PermissionError(f"sandbox: {event} on {args[position]!r} outside the sandbox is not allowed")

    sys.addaudithook(hook)


def run_untrusted(work, options, report, isolation):
    """Steps 5-6, then the script as `__main__`. `report` is closed before the first untrusted line."""
    write_report(report, isolation)
    os.close(report)
    os.chdir(work)
    os.environ["HOME"] = work
    for name in [m for m in sys.modules if m.partition(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]  # a later `import ctypes` goes through the import audit event again
    limit(options)
    script = os.path.join(work, "main.py")
    with open(script, "rb") as file:
        source = file.read()
    main = type(sys)("__main__")  # its own globals, as `python main.py` would give it
    main.__file__, main.__builtins__ = script, __builtins__
    sys.modules["__main__"], sys.argv = main, [script]
    sys.path.insert(0, work)  # the script may import the files written beside it
    if options["audit_hook"] == "1":
        guard(work)
    run_and_exit(source, main)


def run_and_exit(source, main):
    """Run the script, then exit as the interpreter would (non-daemon threads joined, atexit handlers run, stdio
    flushed, status 0, SystemExit's code, or 1 after a traceback) but skip its finalization: in a forked child,
    freeing every object copies the pages it touches (~12 ms a run)."""
    try:
        exec(compile(source, main.__file__, "exec"), main.__dict__)  # noqa: S102 - running the untrusted script is this module's purpose
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        kind, error, trace = sys.exc_info()
        error.__traceback__ = trace.tb_next  # the traceback starts at the script, not at this frame
        sys.excepthook(kind, error, trace.tb_next)
        status = 1
    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: the interpreter exits 120 then
            status = status or 120
    os._exit(status & 0xFF)


def confined_child(libc, directory, options, own_user, alive, report):
    """PID 1 of the new namespaces: steps 2-6. Never returns normally from a setup failure."""
    os.setsid()  # its own session and process group: kill(0, ...) cannot reach the waiter
    try:
        owner = 0 if own_user else NOBODY
        new_root, work = build_root(libc, directory, options, owner)
        pivot(libc, new_root)
        hostname = b"sandbox"
        checked(libc.sethostname(hostname, len(hostname)), "sethostname")
        drop_privileges(libc, to_nobody=not own_user)
        die_with(libc, alive)
        seccomp = install_seccomp(libc)
    except (SetupFailed, OSError) as error:
        write_report(report, {"error": f"sandbox isolation failed: {error}"})
        os._exit(SETUP_FAILED)
    isolation = {
        "mode": "namespaces",
        "namespaces": "mount,pid,net,ipc,uts,cgroup" + (",user" if own_user else ""),
        "network": "netns",
        "filesystem": "private_root",
        "seccomp": seccomp,
        "audit_hook": "on" if options["audit_hook"] == "1" else "off",
        **granted_status(),
    }
    run_untrusted(work, options, report, isolation)


def wait_for(child):
    """The waiter's whole job: exit as the child did (by the same signal if it was killed)."""
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def run_namespaces(directory, options, report):
    try:
        libc = load_libc()
        own_user = enter_namespaces(libc)
    except (SetupFailed, OSError, ImportError) as error:
        write_report(report, {"error": f"the kernel granted no namespaces: {error}"})
        os._exit(SETUP_FAILED)
    alive, keep_alive = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(keep_alive)
        confined_child(libc, directory, options, own_user, alive, report)
        return
    os.close(alive)
    os.close(report)
    wait_for(child)


def run_audit_hook_only(directory, options, report):
    work = os.path.join(directory, "files")
    try:
        libc = load_libc()
        if os.geteuid() == 0:  # nobody must reach and own its directory (the rest of DIRECTORY stays root's)
            for needed in (sys.base_prefix, directory):
                if not open_to_others(os.path.dirname(os.path.realpath(needed))):
                    raise SetupFailed(
                        f"{needed} is out of reach of uid {NOBODY} (a parent directory is closed to "
                        "others): install Python, and set TMPDIR, where all may enter"
                    )
            os.chmod(directory, 0o711)
            for folder, _, names in os.walk(work):
                for path in [folder, *(os.path.join(folder, name) for name in names)]:
                    os.chown(path, NOBODY, NOBODY)
        drop_privileges(libc, to_nobody=os.geteuid() == 0)
        seccomp = install_seccomp(libc)
    except (SetupFailed, OSError, ImportError) as error:
        write_report(report, {"error": f"sandbox privileges could not be dropped: {error}"})
        os._exit(SETUP_FAILED)
    isolation = {"mode": "audit_hook_only", "network": "audit_hook", "filesystem": "audit_hook", "seccomp": seccomp}
    run_untrusted(work, {**options, "audit_hook": "1"}, report, {**isolation, "audit_hook": "on", **granted_status()})


def open_to_others(path):
    """Whether every directory from `/` down to `path` lets others through (the execute bit)."""
    parts = path.strip("/").split("/") if path.strip("/") else []
    return all(os.stat("/" + "/".join(parts[:depth])).st_mode & 0o001 for depth in range(len(parts) + 1))


def main():
    directory = os.path.realpath(sys.argv[1])
    options = dict(item.partition("=")[::2] for item in sys.argv[2:])
    report = os.open(os.path.join(directory, "isolation"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    if options["mode"] == "namespaces":
        run_namespaces(directory, options, report)
    else:
        run_audit_hook_only(directory, options, report)


if __name__ == "__main__":
    main()
