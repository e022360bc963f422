"""Page-aligned host buffers for direct I/O."""

from __future__ import annotations

import numpy as np

from .pools import ALIGN


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """An uninitialised uint8 array whose data pointer is ``align``-aligned."""
    raw = np.empty(int(nbytes) + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + int(nbytes)]


def is_aligned(buf: np.ndarray, align: int = ALIGN) -> bool:
    return buf.ctypes.data % align == 0 and buf.nbytes % align == 0 and buf.flags.c_contiguous
