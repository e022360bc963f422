"""Where a daemon's runtime files live and how an engine finds them.

Shared by both sides: the daemon writes ``daemon.json`` (endpoints, pid) into
its runtime directory; ``TierClient`` and the CLI read it. Kept apart from the
daemon's config so an engine process never imports the daemon.

Defaults follow the XDG base-directory spec: runtime files in
``$XDG_RUNTIME_DIR/kvtier`` (else ``/tmp/kvtier-UID``), NVMe slabs in
``$XDG_DATA_HOME/kvtier`` (else ``~/.local/share/kvtier``). A directory in a
shared place can be pre-created by another local user, who could then plant
files or symlinks in it, so the daemon takes none before ``ensure_private_dir``
has checked it.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
from pathlib import Path
from typing import Mapping, Optional

INFO_FILE = "daemon.json"
TOKEN_FILE = "admin.token"  # the daemon owner's capability, mode 0600
EVENTS_TOPIC = b"kv-events"
IPC_PATH_MAX = 107  # bytes of a unix socket path (sun_path less its NUL; ZeroMQ's IPC_PATH_MAX_LEN on Linux)


class UnsafeDirError(PermissionError):
    """A directory kvtier would use is not safely this user's (a symlink, not a
    directory, or owned by someone else); the message names it and why."""

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


def _xdg(env: str, environ: Optional[Mapping[str, str]] = None) -> str | None:
    """An XDG variable's value if usable (the spec: ignore a relative path)."""
    base = (os.environ if environ is None else environ).get(env)
    return base if base and os.path.isabs(base) else None


RUNTIME_DIR_ENV = "KVTIER_RUNTIME_DIR"


def default_runtime_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    """Runtime directory (sockets) when none is named: ``$KVTIER_RUNTIME_DIR`` (one variable
    that points the daemon, the CLI, clients and the vLLM connector at one directory, e.g.
    /run/kvtier), else per user: $XDG_RUNTIME_DIR/kvtier or /tmp/kvtier-UID.

    The fallback sits directly in the sticky /tmp: no one else can rename or
    remove it there, and ``ensure_private_dir`` refuses it if someone else made it.
    ``environ`` (default: the process's) is the environment the answer is for."""
    named = (os.environ if environ is None else environ).get(RUNTIME_DIR_ENV)
    if named and not os.path.isabs(named):  # each process would resolve it from its own cwd
        raise UnsafeDirError(errno.EINVAL, f"{RUNTIME_DIR_ENV} must be an absolute path; processes started "
                             "in other directories would not find each other", named)
    if named:
        return named
    base = _xdg("XDG_RUNTIME_DIR", environ)
    if base and os.path.isdir(base):  # set but missing (su, sudo, cron): fall back
        return os.path.join(base, "kvtier")
    return f"/tmp/kvtier-{os.getuid()}"


def default_data_dir(environ: Optional[Mapping[str, str]] = None) -> str:
    """Per-user data directory (NVMe slabs): $XDG_DATA_HOME/kvtier or ~/.local/share/kvtier."""
    base = _xdg("XDG_DATA_HOME", environ) or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "kvtier")


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _mkdir_p(p: Path) -> None:
    """``mkdir -p`` with the leaf 0700; a file where a parent should be is ENOTDIR naming ``p``."""
    try:
        os.mkdir(p, 0o700)
    except NotADirectoryError:  # a parent exists as something else than a directory
        blocker = next((q for q in reversed(p.parents) if q.exists() and not q.is_dir()), p.parent)
        raise NotADirectoryError(errno.ENOTDIR, f"{os.strerror(errno.ENOTDIR)} ({blocker} is in the way)",
                                 str(p)) from None
    except FileNotFoundError:
        try:
            os.makedirs(p.parent, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:
            raise NotADirectoryError(errno.ENOTDIR, f"{os.strerror(errno.ENOTDIR)} ({e.filename} is in the way)",
                                     str(p)) from None
        os.mkdir(p, 0o700)


def ensure_private_dir(path: "str | os.PathLike[str]") -> Path:
    """``path`` as a directory only this user can write, created 0700 if missing.

    An existing one must be a real directory (not a symlink) owned by this uid;
    if it is group/other-writable it is ours, so its mode is reset to 0700. Anything
    else raises ``UnsafeDirError``. Missing parents are created as ``mkdir -p`` does.
    The checks run on an O_NOFOLLOW descriptor, so the directory checked is the one fixed."""
    p = Path(path)
    if not str(path):
        raise UnsafeDirError(errno.EPERM, "an empty path is not a directory", str(path))
    try:
        _mkdir_p(p)
    except FileExistsError:
        pass  # checked below, whoever made it
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeDirError(errno.EPERM, f"is a symlink (to {os.readlink(p)!r}), not a directory; refusing to use it", str(p))
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirError(errno.EPERM, "exists and is not a directory; refusing to use it", str(p))
    fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafeDirError(errno.EPERM, f"is owned by {_owner(st.st_uid)}, not by {_owner(os.geteuid())} who runs "
                                    "kvtier; refusing to use it (remove it or choose another directory)", str(p))
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return p


def write_private_file(path: "str | os.PathLike[str]", data: bytes) -> None:
    """Replace ``path`` atomically with ``data``, mode 0600, through a temp file that
    is created new (O_EXCL) and never through a link (O_NOFOLLOW): nothing planted
    in the directory can redirect the write or keep a handle on the file."""
    p = Path(path)
    tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
    try:
        os.unlink(tmp)  # a leftover of a crashed process with this pid (unlink does not follow links)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def endpoints(runtime_dir: str) -> dict[str, str]:
    """The daemon's ZeroMQ endpoints under ``runtime_dir``."""
    d = Path(runtime_dir)
    return {"rpc": f"ipc://{d / 'rpc.sock'}", "telemetry": f"ipc://{d / 'telemetry.sock'}",
            "events": f"ipc://{d / 'events.sock'}"}


def ipc_unreachable(endpoint: str) -> Optional[str]:
    """Why nobody can answer on ``endpoint``, or None when someone may. A daemon killed (SIGKILL,
    the OOM killer) leaves its socket file behind, and ZeroMQ would wait out the caller's whole
    timeout on it; a connect to that file is refused at once. A tcp endpoint, a path too long
    for a probe or a socket this user may not open are left to ZeroMQ."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):]
    if not os.path.exists(path):
        return f"no daemon socket at {endpoint}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return f"nobody listens on {endpoint} (a daemon that did not stop cleanly left the socket file)"
        except OSError:
            return None
    return None


def read_info(runtime_dir: str) -> dict:
    """The running daemon's ``daemon.json`` (raises FileNotFoundError if none)."""
    with open(Path(runtime_dir) / INFO_FILE) as f:
        return json.load(f)


def pid_namespace() -> int:
    """Inode of this process's pid namespace (0 where /proc does not say): an engine sends it
    so the daemon judges its pid only when both live in one pid namespace."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def read_token(runtime_dir: str) -> Optional[str]:
    """The daemon's admin token, where this process may read it (None elsewhere)."""
    try:
        with open(Path(runtime_dir) / TOKEN_FILE) as f:
            return f.read().strip() or None
    except OSError:
        return None


__all__ = ["TOKEN_FILE", "read_token", "pid_namespace", "INFO_FILE", "EVENTS_TOPIC", "UnsafeDirError", "default_runtime_dir",
           "default_data_dir", "ensure_private_dir", "write_private_file", "endpoints", "read_info"]
