"""The daemon pins glibc's malloc thresholds: a large temporary, once freed, must not
make later ones come from a heap that is never given back (an RSS ratchet)."""

import os
import subprocess
import sys

import pytest

from kvtier.daemon.allocator import _glibc, pin_malloc_thresholds

# In a fresh interpreter: free a 4 MiB array (glibc served it with mmap), then hold a
# 1 MiB one and print how many bytes of mmapped chunks that added (mallinfo2.hblkhd).
PROBE = """
import ctypes, sys
import numpy as np
from kvtier.daemon.allocator import pin_malloc_thresholds
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
if sys.argv[1] == "pin":
    assert pin_malloc_thresholds({})
big = np.ones(4 << 20, np.uint8)
del big
before = libc.mallinfo2().hblkhd
held = np.ones(1 << 20, np.uint8)
print(libc.mallinfo2().hblkhd - before)
"""

needs_glibc = pytest.mark.skipif(_glibc() is None or not hasattr(_glibc(), "mallinfo2"),
                                 reason="glibc >= 2.33 only (mallopt, mallinfo2)")


def _mmapped_after_a_large_free(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))})
    return int(out.stdout.strip())


@needs_glibc
def test_pinned_thresholds_keep_large_temporaries_out_of_the_heap():
    assert _mmapped_after_a_large_free("default") == 0  # glibc's ratchet: the 1 MiB array came from the heap
    assert _mmapped_after_a_large_free("pin") >= 1 << 20  # pinned: mmapped, returned to the OS when freed


@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "65536"}, {"MALLOC_TRIM_THRESHOLD_": "0"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}])
def test_an_operators_malloc_settings_are_left_alone(env):
    assert pin_malloc_thresholds(env) is False
