"""glibc malloc settings for a daemon that runs for months.

glibc serves a request of at least ``M_MMAP_THRESHOLD`` (128 KiB) with its own
``mmap`` and returns it to the OS on free. But when such a block is freed, glibc
raises the threshold to its size (up to 32 MiB) and the heap's trim threshold
to twice that: from then on the daemon's numpy temporaries up to the largest one
seen so far come from the heap, and free memory at the heap's top is kept
instead of returned. Measured in ``kvtier bench soak``: the heap grew 0.5 MB in
the last 70 s of a 5-minute run while the traced Python and numpy memory stayed
flat, a ratchet that follows the largest temporary seen. Setting either threshold switches the
adjustment off; the daemon pins both at glibc's own defaults, so its RSS follows
what it holds. The cost is an ``mmap`` and fresh pages for each temporary of at
least 128 KiB; the hot paths allocate far less than that per request.

An operator's own setting (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``
or ``GLIBC_TUNABLES``) is left alone; other C libraries (musl) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Mapping, Optional

log = logging.getLogger("kvtier.allocator")

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 128 << 10  # glibc's default for both
OPERATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def _glibc() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None
    # glibc only: musl has no gnu_get_libc_version, and its mallopt does nothing
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def pin_malloc_thresholds(environ: Mapping[str, str] = os.environ) -> bool:
    """Fix glibc's mmap and trim thresholds at 128 KiB for this process (see the module
    docstring). Returns whether they were set: False without glibc or where the operator
    chose malloc settings of their own."""
    if any(v in environ for v in OPERATOR_VARIABLES) or "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        log.info("malloc thresholds left as the environment sets them")
        return False
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD_BYTES)) and bool(libc.mallopt(M_TRIM_THRESHOLD, THRESHOLD_BYTES))
    if not ok:
        log.warning("mallopt refused the malloc thresholds; RSS may ratchet up with the largest temporary")
    return ok


__all__ = ["pin_malloc_thresholds", "THRESHOLD_BYTES"]
