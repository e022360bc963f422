"""Mapping the daemon's HBM region into an engine process, from what ``register`` returned."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from kvtier.protocol.shm import attach_shm

from .replies import KvtierError

if TYPE_CHECKING:
    from multiprocessing.shared_memory import SharedMemory

    import torch


def map_daemon_region(info: dict) -> "tuple[Optional[torch.Tensor], Optional[SharedMemory]]":
    """(the region as [slots, stride] bytes, the shared-memory segment to release later), or
    (None, None) where the daemon serves no region of its own (the engine gave one)."""
    slots, stride = info.get("hbm_slots", 0), info.get("slot_stride", 0)
    if info.get("hbm_kind") == "shm" and info.get("hbm_name"):
        import torch

        shm = attach_shm(info["hbm_name"])
        view = torch.frombuffer(shm.buf, dtype=torch.uint8, count=slots * stride).view(slots, stride) \
            if slots else torch.empty(0, stride, dtype=torch.uint8)
        return view, shm
    if info.get("hbm_kind") == "cuda" and info.get("hbm_handle"):
        from kvtier.protocol.cuda_ipc import import_handle  # the daemon's own device pool, mapped over CUDA IPC

        try:
            return import_handle(info["hbm_handle"])[: slots * stride].view(slots, stride), None
        except Exception as e:
            raise KvtierError(f"cannot map the daemon's CUDA HBM pool: {e}") from None
    return None, None


__all__ = ["map_daemon_region"]
