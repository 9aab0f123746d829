"""CurveZMQ keys: one server key, and one client key per role, so that the role a request comes from is proven by
the key its connection was encrypted with, not by anything the peer says.

    tandem keys KEYS_DIR                   # = write_keys(KEYS_DIR): server + every role, secrets 0600, dir 0700
    run.curve_keys_dir = "KEYS_DIR"        # every socket of the run then uses CURVE

Files (pyzmq's certificate format, read by `zmq.auth.load_certificate`): `NAME.key` holds a public key,
`NAME.key_secret` the public and the secret key, for NAME in `server` and `ROLES`. Who needs which file:
- a server (the buffer; learner rank 0, which serves the weights): `server.key_secret` and the public `ROLE.key` of
  every role that may connect (a role whose public key is absent cannot connect);
- a client of role R (a generator, a learner rank, ...): `R.key_secret` and `server.key`.
Copy to a machine only what its roles need: a node holding `learner.key_secret` can act as the learner.

Failure modes (`SecurityError`, each naming the file and what to do): a missing file; a secret file that group or
others may access (`chmod 600 FILE`: `write_keys` never makes one, `zmq.auth.create_certificates` does); a public
key file or the directory writable by group or others (anyone could swap in a key of theirs); a directory of the
old layout (one `client` key shared by every role, from `zmq.auth.create_certificates`), refused rather than
loaded: with one key for every role, any generator could report versions or draw batches as the learner.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

ROLES = ("generator", "learner", "reward", "eval", "monitor")  # monitor: stats only (status tools, tests)
SERVER = "server"
_LEGACY_CLIENT = "client"  # the shared client key of the old layout


class SecurityError(RuntimeError):
    """Keys are missing, exposed, or of the old shared layout; or a socket would be exposed without keys."""


def _remake_hint(keys_dir: Path) -> str:
    return f"make per-role keys with `tandem keys {keys_dir}` (a new directory) and point run.curve_keys_dir at it"


def write_keys(keys_dir: Path) -> list[Path]:
    """Create `keys_dir` (mode 0700) with a fresh key pair for the server and for every role in `ROLES`: the public
    `NAME.key` (0644) and `NAME.key_secret` (0600, created with that mode: never readable by others, not even for
    a moment). Returns the files written. Refuses a directory that already holds any of these files (replacing
    keys would lock out every running peer): remove them, or pick another directory."""
    import zmq

    keys_dir = Path(keys_dir)
    names = (SERVER, *ROLES)
    existing = [keys_dir / f"{n}{suffix}" for n in names for suffix in (".key", ".key_secret")]
    taken = [path for path in existing if path.exists()]
    if taken:
        raise SecurityError(f"{keys_dir} already holds keys ({taken[0].name}, ...): remove them or pick another dir")
    keys_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(keys_dir, 0o700)
    written = []
    for name in names:
        public, secret = zmq.curve_keypair()
        written.append(_write(keys_dir / f"{name}.key", 0o644, _certificate(name, public)))
        written.append(_write(keys_dir / f"{name}.key_secret", 0o600, _certificate(name, public, secret)))
    return written


def _certificate(name: str, public: bytes, secret: bytes | None = None) -> str:
    kind = "Secret" if secret is not None else "Public"
    lines = [f"#   ZeroMQ CURVE {kind} Certificate for the tandem role '{name}' (tandem keys)", "metadata", "curve"]
    lines.append(f'    public-key = "{public.decode()}"')
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _write(path: Path, mode: int, text: str) -> Path:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        os.fchmod(handle.fileno(), mode)  # the umask may have taken bits away; never adds any
        handle.write(text)
    return path


def load_secret(keys_dir: Path, name: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys of `name` (`server` or a role) from `keys_dir/NAME.key_secret`. Raises
    SecurityError for a missing file, an old shared-`client` directory, or a file group/others may access."""
    from zmq.auth import load_certificate

    keys_dir = Path(keys_dir)
    _refuse_legacy(keys_dir)
    secret_file = keys_dir / f"{name}.key_secret"
    if not secret_file.is_file():
        raise SecurityError(f"{secret_file}: missing; {_remake_hint(keys_dir)}")
    mode = stat.S_IMODE(secret_file.stat().st_mode)
    if mode & 0o077:
        raise SecurityError(
            f"{secret_file}: a secret key that group or others may read (mode {mode:o}): chmod 600 {secret_file}"
        )
    public, secret = load_certificate(secret_file)
    if secret is None:
        raise SecurityError(f"{secret_file}: holds no secret-key line; {_remake_hint(keys_dir)}")
    return public, secret


def load_public(keys_dir: Path, name: str) -> bytes:
    """The z85 public key of `name` from `keys_dir/NAME.key` (which only its owner may write)."""
    from zmq.auth import load_certificate

    public_file = Path(keys_dir) / f"{name}.key"
    if not public_file.is_file():
        _refuse_legacy(Path(keys_dir))
        raise SecurityError(f"{public_file}: missing; {_remake_hint(Path(keys_dir))}")
    _refuse_writable_by_others(public_file)
    return load_certificate(public_file)[0]


def role_public_keys(keys_dir: Path) -> dict[bytes, str]:
    """z85 public key -> role, for every role whose `ROLE.key` is in `keys_dir` (what a server lets connect).
    Raises SecurityError when there is none, or for an old shared-`client` directory."""
    keys_dir = Path(keys_dir)
    _refuse_writable_by_others(keys_dir)
    present = [role for role in ROLES if (keys_dir / f"{role}.key").is_file()]
    if not present:
        _refuse_legacy(keys_dir)
        raise SecurityError(f"{keys_dir}: no role keys ({', '.join(ROLES)}.key); {_remake_hint(keys_dir)}")
    keys = {load_public(keys_dir, role): role for role in present}
    if len(keys) != len(present):
        raise SecurityError(f"{keys_dir}: two roles share one public key; {_remake_hint(keys_dir)}")
    return keys


def check_keys(keys_dir: Path, clients: tuple[str, ...] = (), serves: bool = False) -> None:
    """Load what a process will: the server's secret and the role keys when it `serves`, each client role's secret
    and the server's public key. Raises SecurityError (naming the file and the fix) on the first problem, so a role
    can refuse to start with one line rather than fail at its first socket."""
    if serves:
        load_secret(keys_dir, SERVER)
        role_public_keys(keys_dir)
    for role in clients:
        load_secret(keys_dir, role)
        load_public(keys_dir, SERVER)


def _refuse_legacy(keys_dir: Path) -> None:
    if (keys_dir / f"{_LEGACY_CLIENT}.key").is_file() and not any((keys_dir / f"{r}.key").is_file() for r in ROLES):
        raise SecurityError(
            f"{keys_dir} holds one 'client' key shared by every role (zmq.auth.create_certificates), which would let "
            f"any peer act as the learner: {_remake_hint(keys_dir)}"
        )


def _refuse_writable_by_others(path: Path) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o022:
        raise SecurityError(
            f"{path}: group or others may write it (mode {mode:o}), so anyone could swap in a key of theirs: "
            f"chmod go-w {path}"
        )
