"""Small files beside the slabs that a restart trusts: the header MAC key (``header.key``)
and the floor of the next run's write sequences (``seq.floor``). Each is written whole
(a temporary file, fsync, rename, directory fsync) before it is used, so a crash leaves
the old file or the new one, never a torn one."""

from __future__ import annotations

import os
import time

KEY_FILE = "header.key"
KEY_BYTES = 16
SEQ_FILE = "seq.floor"
RUN_SPAN = 1 << 40  # write sequences a run may use: ~10^12 slot writes, far beyond any run


def _write_whole(directory: str, name: str, data: bytes) -> None:
    """Replace ``directory/name`` with ``data``, durably; a failure leaves the old file and
    no temporary one, and names the file."""
    path = os.path.join(directory, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if os.write(fd, data) != len(data):
                raise OSError(28, "short write", tmp)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise OSError(e.errno, e.strerror or str(e), path) from None


def _read(directory: str, name: str, size: int) -> bytes:
    """The file's bytes if it holds exactly ``size``, else b""."""
    try:
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read(size + 1)
    except FileNotFoundError:
        return b""
    return data if len(data) == size else b""


def header_key(directory: str, fresh: bool = False) -> bytes:
    """The slab directory's header MAC key: read, or made (``fresh``: always made anew;
    random, 0600). A new key voids every older header: a later scan discards those slots,
    never misreads one."""
    key = b"" if fresh else _read(directory, KEY_FILE, KEY_BYTES)
    if not key:
        key = os.urandom(KEY_BYTES)
        _write_whole(directory, KEY_FILE, key)
    return key


def seq_floor(directory: str) -> int:
    """The first write sequence of this run: above every earlier run's. It is the clock's
    nanoseconds, or the floor the last run left if the clock was set back; the file then
    holds this start plus ``RUN_SPAN``, the floor of the next run. Why: a scan keeps the
    highest sequence of a key, and does not read the slots beyond a tier that shrank, so
    a floor taken from the scan alone let an older copy win when the tier grew back."""
    old = _read(directory, SEQ_FILE, 8)
    start = max(time.time_ns(), int.from_bytes(old, "little") if old else 0)
    _write_whole(directory, SEQ_FILE, (start + RUN_SPAN).to_bytes(8, "little"))
    return start


__all__ = ["KEY_FILE", "SEQ_FILE", "header_key", "seq_floor"]
