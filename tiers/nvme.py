"""NVMe tier: preallocated slab files of self-describing, 4 KiB-aligned slots.

Slot layout: a 4 KiB header followed by the block padded to 4 KiB. The header
holds magic, version, flags (sealed/open), key, payload length, payload
checksum, a write sequence number and a checksum of the header itself. Header
and payload go to disk in one vectored write, so after a crash a slot is
either whole (both checksums match) or detectably torn. ``recover()`` scans
the slabs, verifies both checksums (or, for a fast start, the header's only:
payloads are verified on every read anyway) and returns the newest good copy
of each sealed key; open (written-back, unsealed) blocks belong to sequences of the
dead process and are not recovered.
"""

from __future__ import annotations

import os
import struct
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import xxhash

from kvtier.kernels.checksum import block_checksum

from .aligned import aligned_empty, is_aligned
from .futures import Failures
from .io_backends import IOBackend
from .pools import ALIGN, round_up
from .types import CorruptBlockError

MAGIC = b"KVTSLOT1"
# 2: payload checksums by kernels.checksum's device-computable value (1: xxh3). A slot of
# another version decodes as no header: recovery discards it and the slot is reused.
VERSION = 2
HEADER_BYTES = ALIGN
FLAG_SEALED = 1
_HDR = struct.Struct("<8sIIQQQQ")  # magic, version, flags, key, length, checksum, seq
_HDR_CRC = struct.Struct("<Q")


@dataclass(frozen=True)
class SlotHeader:
    key: int
    length: int
    checksum: int
    seq: int
    flags: int

    @property
    def sealed(self) -> bool:
        return bool(self.flags & FLAG_SEALED)


def _header_crc(body: "bytes | memoryview") -> int:
    """The header's own checksum: host bytes only, so xxh3 (a recovery scan checks
    one per slot, and a numpy call per 48 bytes would cost more than the read)."""
    return xxhash.xxh3_64_intdigest(body)


def encode_header(h: SlotHeader, out: np.ndarray) -> None:
    out[:] = 0
    _pack_header(out.data, h.key, h.length, h.checksum, h.seq, h.flags)


def _pack_header(page: memoryview, key: int, length: int, checksum: int, seq: int, flags: int) -> None:
    """Pack a header into the start of a zeroed page: in place, about 1 µs (a
    ``SlotHeader``, ``bytes`` and a numpy copy per block cost ~9 µs, which at 256
    KiB blocks doubled the CPU a write batch takes and slowed it ~10%)."""
    _HDR.pack_into(page, 0, MAGIC, VERSION, flags, key, length, checksum, seq)
    _HDR_CRC.pack_into(page, _HDR.size, _header_crc(page[: _HDR.size]))


def decode_header(buf: np.ndarray) -> Optional[SlotHeader]:
    raw = buf[: _HDR.size + _HDR_CRC.size].tobytes()
    magic, version, flags, key, length, checksum, seq = _HDR.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        return None
    (crc,) = _HDR_CRC.unpack_from(raw, _HDR.size)
    if crc != _header_crc(raw[: _HDR.size]):
        return None
    return SlotHeader(key, length, checksum, seq, flags)


def _header_pages(n: int) -> np.ndarray:
    """``n`` zeroed, page-aligned header pages, one allocation and one memset in all."""
    pages = aligned_empty(n * HEADER_BYTES).reshape(n, HEADER_BYTES)
    pages[:] = 0
    return pages


@dataclass(frozen=True)
class RecoveredSlot:
    slot: int
    header: SlotHeader


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
        self.slot_bytes = HEADER_BYTES + self.data_stride
        self.slots_per_file = int(slots_per_file)
        self.backend = backend
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._handles: list = []
        self.created: list[str] = []  # slab files this store made (not there before it opened them)
        grown: list[tuple[str, int]] = []  # existing slabs it extended, with their sizes before
        try:
            for i in range(self.n_files):
                count = min(self.slots_per_file, self.n_slots - i * self.slots_per_file)
                path = os.path.join(directory, f"slab-{i:04d}.kvt")
                self._open_slab(path, count * self.slot_bytes, grown)
        except BaseException:
            self._undo_open(grown)
            raise
        self.seq = 0
        self.unreadable = 0  # slots whose read failed during recovery

    @property
    def n_files(self) -> int:
        return (self.n_slots + self.slots_per_file - 1) // self.slots_per_file

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

    def _locate(self, slot: int) -> tuple[object, int]:
        if not 0 <= slot < self.n_slots:
            raise ValueError(f"nvme: slot {slot} out of range [0, {self.n_slots})")
        f, local = divmod(int(slot), self.slots_per_file)
        return self._handles[f], local * self.slot_bytes

    def _payload(self, data: "np.ndarray | torch.Tensor") -> "np.ndarray | torch.Tensor":
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
              checksum: int, sealed: bool, seq: Optional[int] = None) -> "Future[int]":
        """Write header + payload of one slot in one vectored I/O (``seq``: from
        ``reserve_seqs``; a direct caller without one takes the next)."""
        return self.backend.pwrite(*self._write_job(slot, data, key, length, checksum, sealed, seq))

    def _write_job(self, slot: int, data: "np.ndarray | torch.Tensor", key: int, length: int, checksum: int,
                   sealed: bool, seq: Optional[int], hdr: Optional[np.ndarray] = None) -> tuple[Any, list[Any], int]:
        """(handle, [header, payload], offset) of one slot's write; ``hdr``: a zeroed
        header page to fill (default: a new one)."""
        handle, off = self._locate(slot)
        if seq is None:
            seq = int(self.reserve_seqs(1)[0])
        if hdr is None:
            hdr = _header_pages(1)[0]
        _pack_header(hdr.data, int(key), int(length), int(checksum), int(seq), FLAG_SEALED if sealed else 0)
        return handle, [hdr, self._payload(data)], off

    def write_many(self, items: Sequence[tuple[int, "np.ndarray | torch.Tensor", int, int, int, bool, Optional[int]]]
                   ) -> "Future[Failures]":
        """``write`` of many slots (slot, data, key, length, checksum, sealed, seq) as one
        backend call, run one after the other; each fails alone (its error, or None)."""
        pages = _header_pages(len(items))  # one zeroed buffer for the batch's headers
        return self.backend.pwrite_many([self._write_job(*item, hdr=page) for item, page in zip(items, pages)])

    def read(self, slot: int, out: "np.ndarray | torch.Tensor") -> "Future[int]":
        """Read the payload (stride bytes) into ``out``: host memory, or (kvikio) a
        contiguous device slot, read device-direct. Not verified: see ``read_checked``."""
        return self.backend.pread(*self._read_job(slot, out))

    def _read_job(self, slot: int, out: "np.ndarray | torch.Tensor") -> tuple[Any, list[Any], int]:
        """(handle, [payload buffer], offset) of one slot's payload read."""
        handle, off = self._locate(slot)
        if isinstance(out, torch.Tensor):
            if not out.is_cuda:
                out = out.numpy()
            elif not out.is_contiguous():
                raise ValueError("a device read target must be one contiguous slot")
        if out.nbytes != self.data_stride:
            raise ValueError(f"read buffer must be {self.data_stride} bytes, got {out.nbytes}")
        return handle, [out], off + HEADER_BYTES

    def read_checked(self, items: Sequence[tuple[int, "np.ndarray | torch.Tensor", int, Optional[int]]]
                     ) -> "Future[Failures]":
        """Read the payloads of many (slot, out, length, checksum) as one backend call,
        each verified against ``checksum`` (None: an open block's, not verified) on the
        I/O thread that read it, so the checksum of one block overlaps the reads of
        the others. Per item: None, or its error (``CorruptBlockError`` when the bytes
        do not match: they must not be served). A bad argument raises here."""
        jobs = [self._read_job(slot, out) for slot, out, _, _ in items]

        def check(i: int) -> None:
            slot, out, length, checksum = items[i]
            if checksum is not None and block_checksum(out, length) != checksum:
                raise CorruptBlockError(f"NVMe slot {slot} failed its checksum")

        sums = [None if checksum is None else (length, checksum) for _, _, length, checksum in items]
        return self.backend.pread_checked(jobs, check, sums)

    def read_header(self, slot: int) -> Optional[SlotHeader]:
        handle, off = self._locate(slot)
        buf = aligned_empty(HEADER_BYTES)
        self.backend.pread(handle, [buf], off).result()
        return decode_header(buf)

    def recover(self, progress: Optional[Callable[[int], None]] = None,
                batch: int = 64, verify_payload: bool = True) -> tuple[list[RecoveredSlot], int]:
        """Scan every slot; return (newest sealed copy per key, #discarded).

        A slot is discarded if its header is torn, it is open, or (``verify_payload``)
        its payload fails the checksum. Older duplicates of a key are discarded too.
        With ``verify_payload=False`` only the 4 KiB headers are read, so a start
        costs 4 KiB per slot instead of a whole block; a payload torn under a good
        header is then caught by the checksum every NVMe read verifies, and never
        served.
        """
        best: dict[int, RecoveredSlot] = {}
        discarded = 0
        max_seq = 0
        span = self.slot_bytes if verify_payload else HEADER_BYTES
        # headers are small: many per round trip, and 32 per backend call (within one
        # slab file), where a call per 4 KiB read costs as much Python as the read
        chunk = 1 if verify_payload else 32
        if not verify_payload:
            batch = max(batch, 1024)
        for start in range(0, self.n_slots, batch):
            stop = min(self.n_slots, start + batch)
            bufs = [aligned_empty(span) for _ in range(start, stop)]
            calls = []
            lo = start
            while lo < stop:
                hi = min(stop, lo + chunk, (lo // self.slots_per_file + 1) * self.slots_per_file)
                reads = [(bufs[s - start], self._locate(s)[1]) for s in range(lo, hi)]
                calls.append(self.backend.pread_many(self._locate(lo)[0], reads))
                lo = hi
            failures = [err for call in calls for err in call.result()]
            for s, buf, err in zip(range(start, stop), bufs, failures):
                if err is not None:
                    discarded += 1  # an unreadable slot is never served; the slot is reused
                    self.unreadable += 1
                    continue
                h = decode_header(buf[:HEADER_BYTES])
                if h is None:
                    if buf[:8].any():
                        discarded += 1  # written once, now torn
                    continue
                max_seq = max(max_seq, h.seq)
                if not h.sealed or h.length > self.block_bytes or (
                        verify_payload and block_checksum(buf[HEADER_BYTES: HEADER_BYTES + h.length]) != h.checksum):
                    discarded += 1
                    continue
                prev = best.get(h.key)
                if prev is None or prev.header.seq < h.seq:
                    if prev is not None:
                        discarded += 1
                    best[h.key] = RecoveredSlot(s, h)
                else:
                    discarded += 1
            if progress is not None:
                progress(stop - start)
        self.seq = max(self.seq, max_seq)
        return sorted(best.values(), key=lambda r: r.slot), discarded

    def sync(self) -> None:
        """Make every written slot durable (the slot headers are the index)."""
        for h in self._handles:
            self.backend.fsync(h)

    def close(self) -> None:
        for h in self._handles:
            self.backend.close(h)
        self._handles = []

