"""Memory pools for the HBM and DRAM tiers.

A pool is an array of equal-size slots. Slot stride is rounded up to 4 KiB so
that every slot is page aligned: it can then be the source or target of an
O_DIRECT / GDS transfer with no bounce buffer.

* ``HbmPool``: the engine's KV region. A CUDA tensor on GPUs (daemon-allocated
  or supplied by the engine); on CPU-only machines a tensor over POSIX shared
  memory, so an engine process can map the same bytes by name.
* ``DramPool``: host memory owned by the daemon, in POSIX shared memory,
  page-locked with cudaHostRegister where CUDA exists, optionally bound to a
  NUMA node (a CXL expander appears as one).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import queue
from multiprocessing import shared_memory
from typing import Optional

import numpy as np
import torch

from kvtier.protocol.shm import create_shm, release_shm

ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    return (int(n) + align - 1) // align * align


class SlotPool:
    """Common slot arithmetic and byte access for a pool."""

    tier_name = "pool"

    def __init__(self, n_slots: int, block_bytes: int) -> None:
        if n_slots < 0 or block_bytes <= 0:
            raise ValueError("n_slots must be >= 0 and block_bytes > 0")
        self.n_slots = int(n_slots)
        self.block_bytes = int(block_bytes)
        self.slot_stride = round_up(block_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self.n_slots * self.slot_stride

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"{self.tier_name}: slot {slot} out of range [0, {self.n_slots})")

    def host_view(self, slot: int) -> np.ndarray:
        """Writable uint8 view of one slot's block bytes in host memory."""
        raise NotImplementedError

    @property
    def host_array(self) -> Optional[np.ndarray]:
        """Every slot, (slots, stride) uint8, where the pool is host memory (the pool's own view:
        torch's ``numpy()`` of its tensor cost ~30 us cold before each started copy); else None."""
        return None

    def read(self, slot: int) -> bytes:
        return bytes(self.host_view(slot))

    def write(self, slot: int, data: bytes | np.ndarray) -> None:
        buf = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data
        if buf.size > self.block_bytes:
            raise ValueError(f"{buf.size} bytes do not fit a {self.block_bytes}-byte block")
        self.host_view(slot)[: buf.size] = buf.reshape(-1).view(np.uint8)

    def close(self) -> None:
        pass


class HbmPool(SlotPool):
    """Device KV pool as a ``[n_slots, slot_stride]`` uint8 tensor."""

    tier_name = "hbm"

    def __init__(
        self,
        n_slots: int,
        block_bytes: int,
        device: Optional[str] = None,
        tensor: Optional[torch.Tensor] = None,
        shm_name: Optional[str] = None,
    ) -> None:
        super().__init__(n_slots, block_bytes)
        self._shm: Optional[shared_memory.SharedMemory] = None
        self._owns_shm = False
        if tensor is not None:
            flat = tensor.reshape(-1).view(torch.uint8) if tensor.is_contiguous() else None
            if flat is None:
                raise ValueError("an external HBM tensor must be contiguous")
            if flat.numel() < self.capacity_bytes:
                raise ValueError(
                    f"external HBM tensor has {flat.numel()} bytes, need {self.capacity_bytes}"
                )
            self.tensor = flat[: self.capacity_bytes].view(self.n_slots, self.slot_stride)
        else:
            dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
            if dev.startswith("cuda"):
                self.tensor = torch.zeros(self.n_slots, self.slot_stride, dtype=torch.uint8, device=dev)
            else:
                self._shm = create_shm(self.capacity_bytes, shm_name)
                self._owns_shm = True
                self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=self.capacity_bytes).view(
                    self.n_slots, self.slot_stride
                ) if self.capacity_bytes else torch.empty(0, self.slot_stride, dtype=torch.uint8)
        self.device = self.tensor.device
        self._np = None if self.device.type == "cuda" else self.tensor.numpy()

    @property
    def shm_name(self) -> Optional[str]:
        """Name an engine process passes to ``attach_shm`` (CPU only)."""
        return self._shm.name if self._shm is not None else None

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def host_array(self) -> Optional[np.ndarray]:
        return self._np

    def host_view(self, slot: int) -> np.ndarray:
        self._check_slot(slot)
        if self._np is None:
            raise ValueError("HBM pool lives on a CUDA device; use slot_tensor()")
        return self._np[slot, : self.block_bytes]

    def zero(self, slots: np.ndarray) -> None:
        """Zero whole slots (before they hold another namespace's block)."""
        idx = torch.as_tensor(np.asarray(slots, dtype=np.int64), device=self.tensor.device)
        self.tensor.index_fill_(0, idx, 0)
        if self.tensor.is_cuda:  # queued on this process's stream: done before the slot goes to an
            torch.cuda.current_stream(self.tensor.device).synchronize()  # engine, which writes it from its own

    def host_slot(self, slot: int) -> np.ndarray:
        """The whole slot (stride bytes, page aligned) of a host-memory pool, for direct I/O."""
        if self._np is None:
            raise ValueError("HBM pool lives on a CUDA device; use slot_tensor()")
        return self._np[slot]

    def slot_tensor(self, slot: int) -> torch.Tensor:
        self._check_slot(slot)
        return self.tensor[slot, : self.block_bytes]

    def read(self, slot: int) -> bytes:
        return bytes(self.slot_tensor(slot).cpu().numpy())

    def write(self, slot: int, data: bytes | np.ndarray) -> None:
        if self._np is not None:
            return super().write(slot, data)
        buf = np.frombuffer(bytes(data), dtype=np.uint8)
        if buf.size > self.block_bytes:
            raise ValueError(f"{buf.size} bytes do not fit a {self.block_bytes}-byte block")
        self.tensor[slot, : buf.size].copy_(torch.from_numpy(buf.copy()))

    def close(self) -> None:
        self._np = None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._shm is not None:
            release_shm(self._shm, self._owns_shm)
            self._shm = None


def _bind_numa(addr: int, length: int, node: int) -> None:
    """mbind(MPOL_BIND) a range to one NUMA node before first touch."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    nodemask = ctypes.c_ulong(1 << node)
    sys_mbind = {"x86_64": 237, "aarch64": 235}.get(os.uname().machine)
    if sys_mbind is None:
        raise OSError(f"NUMA binding is not supported on {os.uname().machine}")
    mpol_bind = 2
    rc = libc.syscall(sys_mbind, ctypes.c_void_p(addr), ctypes.c_ulong(length), mpol_bind,
                      ctypes.byref(nodemask), ctypes.c_ulong(64), 0)
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mbind to NUMA node {node} failed: {os.strerror(err)}")


def numa_nodes() -> list[int]:
    base = "/sys/devices/system/node"
    try:
        return sorted(int(d[4:]) for d in os.listdir(base) if d.startswith("node") and d[4:].isdigit())
    except FileNotFoundError:
        return [0]


def host_register(array: np.ndarray) -> bool:
    """Page-lock ``array`` for the GPU's DMA engines (cudaHostRegister); False where it fails."""
    rc = torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0)
    return int(rc) == 0 if not isinstance(rc, tuple) else int(rc[0]) == 0


class BounceBuffers:
    """Host buffers of one slot each, allocated once, page aligned (O_DIRECT reads
    land in them) and page-locked where CUDA exists (so a copy to the device is a
    true async DMA). NVMe -> HBM promotions without GPUDirect read and verify here,
    then copy to the device; a buffer goes back with the event of that copy and is
    handed out again only once the event is done."""

    def __init__(self, count: int, stride: int, pin: Optional[bool] = None) -> None:
        if count <= 0 or stride <= 0:
            raise ValueError("count and stride must be > 0")
        self.stride = int(stride)
        raw = np.empty(count * self.stride + ALIGN, dtype=np.uint8)  # page aligned, as aligned_empty
        off = (-raw.ctypes.data) % ALIGN
        self.array = raw[off: off + count * self.stride].reshape(count, self.stride)
        want_pin = torch.cuda.is_available() if pin is None else pin
        self.pinned = bool(want_pin) and host_register(self.array)
        self._free: "queue.SimpleQueue[int]" = queue.SimpleQueue()
        self._pending: list[Optional[torch.cuda.Event]] = [None] * count
        for i in range(count):
            self._free.put(i)

    def __len__(self) -> int:
        return len(self._pending)

    def take(self, n: int) -> list[int]:
        """At least one buffer (waits for the first) and at most ``n``: a taker never
        waits while it holds buffers, so concurrent takers cannot deadlock."""
        out = [self._free.get()]
        while len(out) < n:
            try:
                out.append(self._free.get_nowait())
            except queue.Empty:
                break
        for i in out:
            ev, self._pending[i] = self._pending[i], None
            if ev is not None:
                ev.synchronize()  # the last copy out of this buffer has landed
        return out

    def give(self, i: int, copy_done: Optional[torch.cuda.Event] = None) -> None:
        self._pending[i] = copy_done
        self._free.put(i)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.array.ctypes.data)
            self.pinned = False


class DramPool(SlotPool):
    """Host slot pool in POSIX shared memory."""

    tier_name = "dram"

    def __init__(
        self,
        n_slots: int,
        block_bytes: int,
        numa_node: Optional[int] = None,
        pin: Optional[bool] = None,
        shm_name: Optional[str] = None,
    ) -> None:
        super().__init__(n_slots, block_bytes)
        if numa_node is not None and numa_node not in numa_nodes():
            raise ValueError(f"NUMA node {numa_node} does not exist (have {numa_nodes()})")

        def bind(shm: shared_memory.SharedMemory) -> None:  # before create_shm reserves the pages
            if numa_node is not None and self.capacity_bytes:
                assert shm.buf is not None  # a segment just created is mapped
                _bind_numa(np.frombuffer(shm.buf, dtype=np.uint8).ctypes.data, self.capacity_bytes, numa_node)

        self._shm = create_shm(self.capacity_bytes, shm_name, prepare=bind)
        self.array = np.ndarray((self.n_slots, self.slot_stride), dtype=np.uint8, buffer=self._shm.buf)
        self.numa_node = numa_node
        want_pin = torch.cuda.is_available() if pin is None else pin
        self.pinned = False
        if want_pin and self.capacity_bytes:
            try:
                self.pinned = host_register(self.array)
            except BaseException:  # a pool that failed to build is closed by no one: unlink its segment now
                self.array = None  # type: ignore[assignment]  # drop the view so the mapping can close
                release_shm(self._shm, True)
                raise
        self.tensor = torch.from_numpy(self.array)

    @property
    def shm_name(self) -> str:
        return self._shm.name

    def host_view(self, slot: int) -> np.ndarray:
        self._check_slot(slot)
        return self.array[slot, : self.block_bytes]

    @property
    def host_array(self) -> Optional[np.ndarray]:
        return self.array

    def host_view_all(self) -> np.ndarray:
        """Every slot as one flat uint8 array (benchmarks, bulk initialisation)."""
        return self.tensor.numpy().reshape(-1)

    def slot_buffer(self, slot: int) -> np.ndarray:
        """Whole page-aligned slot (stride bytes), for direct I/O."""
        self._check_slot(slot)
        return self.array[slot]

    def close(self) -> None:
        if self._shm is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.array.ctypes.data)
            self.pinned = False
        self.tensor = None  # type: ignore[assignment]  # a closed pool drops its buffers; nothing reads them after
        self.array = None  # type: ignore[assignment]  # (as above)
        release_shm(self._shm, True)
        self._shm = None  # type: ignore[assignment]  # (as above)
