"""A restart's scan of the NVMe tier: which sealed blocks the slabs still hold.

Headers lie packed, 512 to a group (``slab_layout``), so the scan reads a group's
headers in one 2 MiB read instead of 512 small ones; a read that fails is read
again header by header, so a bad sector costs the slots under it and no others. A
slot is discarded if its header is torn, it is open, or (``verify_payload``) its
payload fails the checksum; older copies of a key are discarded too. A header page
that holds bytes but no header of this version (torn, or left by an older layout,
whose payload bytes now lie where headers go) is zeroed once found, so the next
start does not count it again. With ``verify_payload=False`` only headers are
read; a payload torn under a good header is then caught by the checksum every NVMe
read verifies, and never served.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import numpy as np

from kvtier.kernels.checksum import block_checksum

from .aligned import aligned_empty
from .slab_layout import GROUP, HEADER_BYTES, SlabLayout
from .slot_header import RecoveredSlot, SlotHeader, decode_header, newer_version


class Store(Protocol):
    """What the scan needs of a store (``NvmeStore``), without importing it: the store calls the scan."""

    layout: SlabLayout
    backend: Any
    data_stride: int
    block_bytes: int
    unreadable: int
    mac_key: bytes

    def place(self, slot: int) -> bytes: ...

    def header_at(self, slot: int) -> tuple[Any, int]: ...

    def payload_at(self, slot: int) -> tuple[Any, int]: ...

HEADERS_PER_READ = GROUP  # a group's headers are contiguous; the next group's lie past its payloads


def _read_headers(store: Store, first: int, n: int) -> tuple[np.ndarray, list[bool]]:
    """Headers of slots ``first .. first + n - 1`` (one slab file) and which could not be read."""
    pages = aligned_empty(n * HEADER_BYTES).reshape(n, HEADER_BYTES)
    handle, off = store.header_at(first)
    if store.backend.pread_many(handle, [(pages.reshape(-1), off)]).result()[0] is None:
        return pages, [False] * n
    reads = [(pages[j], off + j * HEADER_BYTES) for j in range(n)]  # the run failed: each alone
    return pages, [err is not None for err in store.backend.pread_many(handle, reads).result()]


def _zero_headers(store: Store, slots: list[int], seen: list[np.ndarray]) -> None:
    """Zero the header pages of ``slots`` (one file), whose bytes ``seen`` held no header of
    this version, so each is discarded, and counted, once. Each page is read again first and
    zeroed only if it reads back the same: a page garbled in flight is not the disk's, and a
    good header must not be erased for it. A newer version's header is left alone (it is
    skipped, not ours to erase). A page that cannot be written stays: it is discarded again."""
    if not slots:
        return
    handle = store.header_at(slots[0])[0]
    again = aligned_empty(len(slots) * HEADER_BYTES).reshape(len(slots), HEADER_BYTES)
    failures = store.backend.pread_many(handle, [(page, store.header_at(s)[1]) for page, s in zip(again, slots)]
                                        ).result()
    zero = aligned_empty(HEADER_BYTES)
    zero[:] = 0
    jobs = []
    for s, page, first, err in zip(slots, again, seen, failures):
        if err is None and np.array_equal(page, first) and not newer_version(page):
            jobs.append((handle, [zero], store.header_at(s)[1]))
    if jobs:
        store.backend.pwrite_many(jobs).result()


def _verified(store: Store, found: list[tuple[int, SlotHeader]], batch: int
              ) -> tuple[list[tuple[int, SlotHeader]], int, int]:
    """The slots of ``found`` (one slab file) whose payload reads back with its checksum;
    (kept, discarded, unreadable)."""
    kept: list[tuple[int, SlotHeader]] = []
    discarded = unreadable = 0
    threads = max(1, int(getattr(store.backend, "threads", 1)))
    for lo in range(0, len(found), max(1, batch)):
        part = found[lo: lo + max(1, batch)]
        bufs = aligned_empty(len(part) * store.data_stride).reshape(len(part), store.data_stride)
        handle = store.payload_at(part[0][0])[0]
        reads = [(buf, store.payload_at(s)[1]) for buf, (s, _) in zip(bufs, part)]
        share = -(-len(reads) // threads)  # one call per I/O thread: all of them read at once
        calls = [store.backend.pread_many(handle, reads[i: i + share]) for i in range(0, len(reads), share)]
        failures = [err for call in calls for err in call.result()]
        for buf, (s, h), err in zip(bufs, part, failures):
            if err is not None:
                discarded += 1
                unreadable += 1
            elif block_checksum(buf[: h.length]) != h.checksum:
                discarded += 1
            else:
                kept.append((s, h))
    return kept, discarded, unreadable


def scan(store: Store, progress: Optional[Callable[[int], None]], batch: int,
         verify_payload: bool) -> tuple[list[RecoveredSlot], int, int]:
    """(newest sealed copy per key in slot order, slots discarded, highest sequence seen);
    counts unreadable slots in ``store.unreadable``."""
    best: dict[int, RecoveredSlot] = {}
    discarded = max_seq = 0
    layout = store.layout
    for f in range(layout.n_files):
        base, count = f * layout.slots_per_file, layout.count(f)
        for lo in range(0, count, HEADERS_PER_READ):
            n = min(HEADERS_PER_READ, count - lo)
            pages, failed = _read_headers(store, base + lo, n)
            found: list[tuple[int, SlotHeader]] = []
            junk: list[int] = []
            junk_pages: list[np.ndarray] = []
            for j in range(n):
                if failed[j]:
                    discarded += 1  # an unreadable slot is never served; the slot is reused
                    store.unreadable += 1
                    continue
                h = decode_header(pages[j], store.mac_key, store.place(base + lo + j))
                if h is None:
                    if pages[j].any():  # written once, now torn (or another version's)
                        discarded += 1
                        junk.append(base + lo + j)
                        junk_pages.append(pages[j])
                    continue
                max_seq = max(max_seq, h.seq)
                if not h.sealed or h.length > store.block_bytes:
                    discarded += 1
                    continue
                found.append((base + lo + j, h))
            _zero_headers(store, junk, junk_pages)
            if verify_payload:
                found, bad, unreadable = _verified(store, found, batch)
                discarded += bad
                store.unreadable += unreadable
            for s, h in found:
                prev = best.get(h.key)
                if prev is None or prev.header.seq < h.seq:
                    discarded += prev is not None
                    best[h.key] = RecoveredSlot(s, h)
                else:
                    discarded += 1
            if progress is not None:
                progress(n)
    return sorted(best.values(), key=lambda r: r.slot), discarded, max_seq
