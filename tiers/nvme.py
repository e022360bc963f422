"""NVMe tier: preallocated slab files of self-describing, 4 KiB-aligned slots.

Each slot has a 4 KiB header and the block padded to 4 KiB. The header holds magic,
version, flags (sealed/open), key, payload length, payload checksum, a write
sequence number and a MAC of the header itself (keyed by the directory's secret, bound
to the slot and layout: ``slot_header``). A slab keeps its headers packed
in groups of 512 with their payloads after them at aligned offsets (``slab_layout``:
aligned payload writes ran 13-22% faster here). A batch writes its payloads first and
then the headers of those that landed, one write per run of consecutive slots: a
header is issued only once its payload's write completed (``batch_headers``). Nothing is flushed between
them, so crash safety rests, as before, on the checksums: after a crash a slot's
header is whole or detectably torn, and a payload torn or stale under a good header
fails the checksum every NVMe read verifies, and is never served. ``recover()``
(``nvme_recovery``) scans the headers, verifies both checksums (or, for a fast start,
the header's only) and returns the newest good copy of each sealed key; open
(written-back, unsealed) blocks belong to sequences of the dead process and are not
recovered.
"""

from __future__ import annotations

import os
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from kvtier.kernels.checksum import block_checksum

from . import nvme_batch
from .aligned import PageCache, aligned_empty, is_aligned
from .futures import Failures, mapped
from .io_backends import IOBackend
from .nvme_recovery import scan
from .pools import round_up
from .slab_layout import HEADER_BYTES, SlabLayout
from .slab_state import header_key, seq_floor
from .slot_header import RecoveredSlot, SlotHeader, decode_header, header_place
from .types import CorruptBlockError


class NvmeStore:
    """Slot I/O over slab files in one directory."""

    def __init__(
        self,
        directory: str,
        n_slots: int,
        block_bytes: int,
        backend: IOBackend,
        slots_per_file: int = 65536,
    ) -> None:
        if n_slots < 0 or block_bytes <= 0 or slots_per_file <= 0:
            raise ValueError("n_slots >= 0, block_bytes > 0 and slots_per_file > 0 required")
        self.directory = directory
        self.n_slots = int(n_slots)
        self.block_bytes = int(block_bytes)
        self.data_stride = round_up(block_bytes)
        self.slots_per_file = int(slots_per_file)
        self.layout = SlabLayout(self.n_slots, self.data_stride, self.slots_per_file)
        self.backend = backend
        self.header_pages = PageCache(HEADER_BYTES)  # a batch's header pages, reused once it is done
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._handles: list = []
        self.created: list[str] = []  # slab files this store made (not there before it opened them)
        grown: list[tuple[str, int]] = []  # existing slabs it extended, with their sizes before
        try:
            for i in range(self.n_files):
                self._open_slab(os.path.join(directory, f"slab-{i:04d}.kvt"), self.layout.file_bytes(i), grown)
            self.mac_key = header_key(directory)  # the headers' MAC key (``slot_header``), once the slabs fit
            self.seq = seq_floor(directory)  # writes outrank every header on disk (``slab_state``)
        except BaseException:
            self._undo_open(grown)
            raise
        self.unreadable = 0  # slots whose read failed during recovery

    @property
    def n_files(self) -> int:
        return self.layout.n_files

    def _open_slab(self, path: str, size: int, grown: list[tuple[str, int]]) -> None:
        """Open (create, preallocate) one slab; an OSError names the file (posix_fallocate's does not)."""
        try:
            before = os.stat(path).st_size
        except FileNotFoundError:
            self.created.append(path)
        else:
            if before < size:
                grown.append((path, before))
        try:
            self._handles.append(self.backend.open(path, size))
        except OSError as e:
            if e.filename:
                raise
            raise OSError(e.errno, e.strerror or str(e), path) from None

    def _undo_open(self, grown: list[tuple[str, int]]) -> None:
        """Undo a failed open: a slab partly preallocated before ENOSPC holds the
        filesystem's free space, so new files go and extended ones shrink back."""
        self.close()
        for path in self.created:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        for path, size in grown:
            try:
                os.truncate(path, size)
            except OSError:
                pass
        self.created = []

    @property
    def capacity_bytes(self) -> int:
        return self.n_slots * self.data_stride

    @property
    def direct(self) -> bool:
        return all(getattr(h, "direct", True) for h in self._handles)

    def header_at(self, slot: int) -> tuple[Any, int]:
        """(handle, offset) of ``slot``'s header; a slot out of range raises ValueError."""
        f, off = self.layout.header_offset(slot)
        return self._handles[f], off

    def payload_at(self, slot: int) -> tuple[Any, int]:
        """(handle, offset) of ``slot``'s payload; a slot out of range raises ValueError."""
        f, off = self.layout.payload_offset(slot)
        return self._handles[f], off

    def place(self, slot: int) -> bytes:
        """Where ``slot``'s header lies, as its MAC covers it."""
        return header_place(int(slot), self.data_stride, self.slots_per_file)

    def payload_buffer(self, data: "np.ndarray | torch.Tensor") -> "np.ndarray | torch.Tensor":
        """The payload buffer padded to the stride, bounced if misaligned. A device
        tensor (GPUDirect through kvikio) goes as it is: it must fill the slot."""
        if isinstance(data, torch.Tensor):
            if not data.is_cuda:
                data = data.numpy()
            elif data.nbytes != self.data_stride or not data.is_contiguous():
                raise ValueError(f"a device payload must be one contiguous {self.data_stride}-byte slot, "
                                 f"got {data.nbytes} bytes")
            else:
                return data
        if data.nbytes == self.data_stride and is_aligned(data):
            return data
        if data.nbytes > self.data_stride:
            raise ValueError(f"{data.nbytes} bytes exceed the {self.data_stride}-byte slot")
        bounce = aligned_empty(self.data_stride)
        bounce[: data.nbytes] = data.reshape(-1).view(np.uint8)
        bounce[data.nbytes :] = 0
        return bounce

    def reserve_seqs(self, n: int) -> np.ndarray:
        """The next ``n`` write sequence numbers. Taken by the owner thread when it
        submits writes, so the order on disk is the order decided, whatever order
        the I/O threads finish in (recovery keeps the highest sequence of a key)."""
        out = np.arange(self.seq + 1, self.seq + 1 + n, dtype=np.uint64)
        self.seq += n
        return out

    def write(self, slot: int, data: "np.ndarray | torch.Tensor", key: int, length: int,
              checksum: int, sealed: bool, seq: Optional[int] = None, owner: int = 0) -> "Future[int]":
        """Write one slot, payload then header (``seq``: from ``reserve_seqs``; a direct
        caller without one takes the next); the result is the bytes written."""
        def total(failures: Failures) -> int:
            if failures[0] is not None:
                raise failures[0]
            return HEADER_BYTES + self.data_stride

        return mapped(self.write_many([(slot, data, key, length, checksum, sealed, seq, owner)]), total)

    def write_many(self, items: Sequence[tuple[Any, ...]]) -> "Future[Failures]":
        """Write many slots (slot, data, key, length, checksum, sealed, seq[, owner]) as one
        backend call: payloads, then the headers of those that landed (``nvme_batch``)."""
        return nvme_batch.write_many(self, items)

    def write_rows(self, slots: np.ndarray, rows: np.ndarray, idx: np.ndarray, fields: dict[str, np.ndarray],
                   parts: int = 1) -> list[tuple[np.ndarray, "Future[Failures]"]]:
        """Write slot ``slots[i]`` from host row ``rows[idx[i]]``, headers from ``fields``, in
        up to ``parts`` calls: each call's items and future (``nvme_batch.write_rows``)."""
        return nvme_batch.write_rows(self, slots, rows, idx, fields, parts)

    def read_rows(self, slots: np.ndarray, rows: np.ndarray, idx: np.ndarray, lengths: np.ndarray,
                  checksums: np.ndarray, parts: int = 1) -> list[tuple[np.ndarray, "Future[Failures]"]]:
        """Read slot ``slots[i]`` into host row ``rows[idx[i]]``, verified, in up to ``parts``
        calls: each call's items and future (``nvme_batch.read_rows``)."""
        return nvme_batch.read_rows(self, slots, rows, idx, lengths, checksums, parts)

    @property
    def handles(self) -> list:
        """The slab files' backend handles, in file order."""
        return self._handles

    def read(self, slot: int, out: "np.ndarray | torch.Tensor") -> "Future[int]":
        """Read the payload (stride bytes) into ``out``: host memory, or (kvikio) a
        contiguous device slot, read device-direct. Not verified: see ``read_checked``."""
        return self.backend.pread(*self._read_job(slot, out))

    def _read_job(self, slot: int, out: "np.ndarray | torch.Tensor") -> tuple[Any, list[Any], int]:
        """(handle, [payload buffer], offset) of one slot's payload read."""
        handle, off = self.payload_at(slot)
        if isinstance(out, torch.Tensor):
            if not out.is_cuda:
                out = out.numpy()
            elif not out.is_contiguous():
                raise ValueError("a device read target must be one contiguous slot")
        if out.nbytes != self.data_stride:
            raise ValueError(f"read buffer must be {self.data_stride} bytes, got {out.nbytes}")
        return handle, [out], off

    def read_checked(self, items: Sequence[tuple[int, "np.ndarray | torch.Tensor", int, Optional[int]]]
                     ) -> "Future[Failures]":
        """Read the payloads of many (slot, out, length, checksum) as one backend call,
        each verified against ``checksum`` (None: an open block's, not verified) on the
        I/O thread that read it, so the checksum of one block overlaps the reads of
        the others. Per item: None, or its error (``CorruptBlockError`` when the bytes
        do not match: they must not be served). A buffer of the wrong size raises here;
        one the backend cannot take fails the returned future."""
        jobs = [self._read_job(slot, out) for slot, out, _, _ in items]

        def check(i: int) -> None:
            slot, out, length, checksum = items[i]
            if checksum is not None and block_checksum(out, length) != checksum:
                raise CorruptBlockError(f"NVMe slot {slot} failed its checksum")

        sums = [None if checksum is None else (length, checksum) for _, _, length, checksum in items]
        return self.backend.pread_checked(jobs, check, sums)

    def read_header(self, slot: int) -> Optional[SlotHeader]:
        handle, off = self.header_at(slot)
        buf = aligned_empty(HEADER_BYTES)
        self.backend.pread(handle, [buf], off).result()
        return decode_header(buf, self.mac_key, self.place(slot))

    def recover(self, progress: Optional[Callable[[int], None]] = None,
                batch: int = 64, verify_payload: bool = True) -> tuple[list[RecoveredSlot], int]:
        """Scan every slot; return (newest sealed copy per key, #discarded): see ``nvme_recovery``."""
        found, discarded, max_seq = scan(self, progress, batch, verify_payload)
        self.seq = max(self.seq, max_seq)
        return found, discarded

    def void_headers(self) -> None:
        """Void every header on disk at once (``kvtier clear``): a new MAC key, durable before
        it returns, so what was cleared never comes back at a later scan, whichever copies of
        it the slabs still hold. Headers written from now on use the new key; blocks the
        caller keeps are still read by their own checksums (and a clean stop's index lists
        them), but a scan after a crash no longer finds them."""
        self.mac_key = header_key(self.directory, fresh=True)

    def sync(self) -> None:
        """Make every written slot durable (the slot headers are the index)."""
        for h in self._handles:
            self.backend.fsync(h)

    def close(self) -> None:
        for h in self._handles:
            self.backend.close(h)
        self._handles = []

