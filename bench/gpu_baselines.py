"""Raw GPU baselines for ``bench tiers``: pinned host<->device copies and raw kvikio I/O.

Measured on the same bytes and block size as the kvtier figures they divide;
on a machine without CUDA (or without kvikio) each ratio is null with a reason.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

from kvtier.tiers.manager import TierManager

GPU_RATIOS = ("h2d", "d2h", "kvikio_read", "kvikio_write")


class GpuBaselines:
    """Raw GPU figures on the same bytes: pinned cudaMemcpyAsync each way (torch
    ``copy_`` non_blocking from/to page-locked memory, timed with CUDA events) and
    kvikio reads/writes of device memory, one per block, all in flight at once."""

    def __init__(self, directory: str, block: int, n: int, kvikio_file: bool) -> None:
        self.block, self.n = block, n
        self.host = torch.full((block * n,), 7, dtype=torch.uint8).pin_memory()
        self.dev = torch.zeros(block * n, dtype=torch.uint8, device="cuda")
        self.path = os.path.join(directory, "raw-kvikio.bin")
        self.file: Any = None
        if kvikio_file:
            import kvikio

            self.file = kvikio.CuFile(self.path, "w+")

    def _timed(self, copy: Callable[[], object]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def h2d(self) -> float:
        return self._timed(lambda: self.dev.copy_(self.host, non_blocking=True))

    def d2h(self) -> float:
        return self._timed(lambda: self.host.copy_(self.dev, non_blocking=True))

    def _io(self, method: str) -> None:
        b = self.block
        futs = [getattr(self.file, method)(self.dev[i * b:(i + 1) * b], b, i * b) for i in range(self.n)]
        for f in futs:
            f.get()

    def kvikio_write(self) -> None:
        self._io("pwrite")

    def kvikio_read(self) -> None:
        self._io("pread")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            os.unlink(self.path)


def gpu_reasons(m: TierManager) -> dict[str, str]:
    """Why each GPU ratio cannot be measured here (empty: all can)."""
    from kvtier.tiers.io_backends import kvikio_status

    if not torch.cuda.is_available() or not m.hbm.is_cuda:
        return {k: "no CUDA device: GPU baselines not measured" for k in GPU_RATIOS}
    if m.backend.name != "kvikio":
        why = f"io backend is {m.backend.name} ({kvikio_status()[1]})"
        return {"kvikio_read": why, "kvikio_write": why}
    return {}


__all__ = ["GPU_RATIOS", "GpuBaselines", "gpu_reasons"]
