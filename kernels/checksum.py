"""Block checksums: xxh3-64 over the block's valid bytes.

xxh3 runs at memory bandwidth on one core, so verifying every NVMe read (the
exactness contract) costs little next to the read itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash


def block_checksum(buf: Any, length: int | None = None) -> int:
    """64-bit checksum of ``buf[:length]`` (numpy array, bytes, or CPU tensor)."""
    if hasattr(buf, "numpy") and hasattr(buf, "device"):
        if buf.device.type != "cpu":
            buf = buf.cpu()
        buf = buf.numpy()
    if isinstance(buf, np.ndarray):
        mv = buf.reshape(-1).view(np.uint8).data
    else:
        mv = memoryview(buf)
    if length is not None:
        mv = mv[:length]
    return xxhash.xxh3_64_intdigest(mv)
