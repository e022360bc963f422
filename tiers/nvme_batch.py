"""Batched slot I/O of the NVMe tier: writes (payloads first, then the headers of
those that landed) and verified reads of many slots.

A batch writes every payload in slot order, then the headers of the slots whose
payloads landed, one write per run of consecutive slots over the whole batch, by the
part that finished last (``batch_headers``: a 4 KiB write per header between the
payloads cost more than the aligned layout gains, and a header write per part cost
the batch 5-15%). Each slot fails alone, its payload's error or else its header
run's; a slot whose payload failed keeps its old header. A bad slot or header field
raises before any I/O; a buffer the backend refuses fails each slot of its share
(posix makes its views on the I/O thread).

Two ways in. ``write_many`` takes a tuple a slot, any buffer (bounced where it is
not an aligned whole slot). ``write_rows`` and ``read_rows`` take arrays whose
payloads are rows of one host array (a memory pool), the mover's way: no Python
object a block but its I/O, split into consecutive slot ranges, one an I/O thread;
each range's jobs (``RowJobs``) are made on the I/O thread that runs it, and a
write's headers are packed there once its payloads landed, beside the other
threads' writes (the last part then writes them all). Why: at ~20 µs of Python a
block, a mover thread preparing a batch held the GIL for milliseconds while the I/O
threads it had just handed work to waited for it (up to 5 ms a switch): on a 2-core
host the disk had its full queue only 15 ms into a 100 ms batch.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from concurrent.futures import Future
from typing import Any, Iterator, Optional, Protocol, Sequence

import numpy as np

from kvtier.kernels.checksum import block_checksum

from .aligned import PageCache
from .batch_headers import BatchHeaders
from .futures import Failures, mapped
from .pools import ALIGN
from .slab_layout import SlabLayout
from .slot_header import FLAG_SEALED, pack_headers
from .types import CorruptBlockError

Job = tuple[Any, list[Any], int]  # (handle, buffers, offset)
HEADER_FIELDS = ("key", "length", "checksum", "sealed", "seq", "owner")


class NvmeStore(Protocol):
    """What a batch needs of the store (``nvme.NvmeStore``), without importing it: the store calls the batch."""

    layout: SlabLayout
    backend: Any
    data_stride: int
    slots_per_file: int
    mac_key: bytes
    header_pages: PageCache

    @property
    def handles(self) -> list: ...

    def place(self, slot: int) -> bytes: ...

    def header_at(self, slot: int) -> tuple[Any, int]: ...

    def payload_at(self, slot: int) -> tuple[Any, int]: ...

    def payload_buffer(self, data: Any) -> Any: ...

    def reserve_seqs(self, n: int) -> np.ndarray: ...

    def read_checked(self, items: Sequence[tuple[int, Any, int, Optional[int]]]) -> "Future[Failures]": ...


def write_many(store: NvmeStore, items: Sequence[tuple[Any, ...]]) -> "Future[Failures]":
    """Write slots (slot, data, key, length, checksum, sealed, seq[, owner]) as one
    backend call; the result is each item's failure (None: it landed). Headers are
    packed as ``write_rows`` packs them, once the payloads landed."""
    n = len(items)
    order = sorted(range(n), key=lambda i: int(items[i][0]))
    if any(items[a][0] == items[b][0] for a, b in zip(order, order[1:])):
        raise ValueError("write_many: a slot is named twice")  # whose header would describe which payload?
    jobs: list[Job] = []
    header: dict[str, list[int]] = {name: [] for name in ("key", "length", "checksum", "seq", "flags", "owner")}
    for i in order:
        slot, data, key, length, checksum, sealed, seq = items[i][:7]
        handle, off = store.payload_at(int(slot))
        jobs.append((handle, [store.payload_buffer(data)], off))
        for name, value in (("key", key), ("length", length), ("checksum", checksum), ("flags", FLAG_SEALED if sealed else 0),
                            ("owner", items[i][7] if len(items[i]) > 7 else 0),
                            ("seq", store.reserve_seqs(1)[0] if seq is None else seq)):
            header[name].append(int(value))
    ranked = np.array([int(items[i][0]) for i in order], dtype=np.int64)
    columns = {name: np.array(col, dtype=np.uint64) for name, col in header.items()}  # out of range: raises here
    pages = store.header_pages.take(n)  # in slot order: consecutive slots' headers are one buffer
    batch = _headers(store, pages, ranked, [(0, n)], columns)
    try:
        batch.issued(0, store.backend.pwrite_many(jobs, batch.then_of(0)))
    except BaseException:
        store.header_pages.give(pages, reuse=False)  # a backend may have issued some writes (kvikio, faults)
        raise

    def per_item(failures: Failures) -> Failures:
        out: Failures = [None] * n
        for r, i in enumerate(order):
            out[i] = failures[r]
        return out

    return mapped(batch.result(0), per_item)


def write_rows(store: NvmeStore, slots: np.ndarray, rows: np.ndarray, idx: np.ndarray,
               fields: dict[str, np.ndarray], parts: int = 1) -> list[tuple[np.ndarray, "Future[Failures]"]]:
    """Write slot ``slots[i]`` from ``rows[idx[i]]`` with a header of ``fields``' row i
    (arrays: key, length, checksum, sealed, seq, owner; seq may be None), in up to
    ``parts`` backend calls of consecutive slots (one an I/O thread). The result is
    each call's items (indices into ``slots``) and the future of their failures, in
    that order. Rows that are not whole aligned slots go through ``write_many``."""
    missing = [k for k in HEADER_FIELDS if k != "seq" and fields.get(k) is None]
    if missing:
        raise ValueError(f"write_rows: header fields {missing} are missing")
    seq = fields.get("seq")
    slots, idx = _checked(store, slots, rows, idx, [fields[k] for k in HEADER_FIELDS if fields.get(k) is not None])
    n = slots.size
    if not _slot_rows(store, rows):
        return [(np.arange(n), write_many(store, [
            (int(slots[i]), rows[idx[i]], int(fields["key"][i]), int(fields["length"][i]),
             int(fields["checksum"][i]), bool(fields["sealed"][i]), None if seq is None else int(seq[i]),
             int(fields["owner"][i])) for i in range(n)]))]
    order, ranked, files, offsets = _ranked(store, slots)
    header = {"key": fields["key"][order], "length": fields["length"][order],
              "checksum": fields["checksum"][order],
              "flags": np.where(np.asarray(fields["sealed"])[order], FLAG_SEALED, 0), "owner": fields["owner"][order]}
    # sequences in slot order, as write_many takes them; reserved once the batch is known good
    header["seq"] = store.reserve_seqs(n) if seq is None else np.asarray(seq)[order]
    if not n:
        return []  # no part: nothing would give the header pages back
    handles, src = store.handles, idx[order].tolist()
    bounds = _parts(n, parts)
    batch = _headers(store, store.header_pages.take(n), ranked, bounds, header)
    out = []
    for k, (a, b) in enumerate(bounds):
        try:  # once a part is out, a later one's error is that part's failure, never a raise
            batch.issued(k, store.backend.pwrite_many(RowJobs(handles, rows, files[a:b], src[a:b], offsets[a:b]),
                                                      batch.then_of(k)))
        except Exception as e:
            batch.refused(k, e)
        out.append((order[a:b], batch.result(k)))
    return out


def _headers(store: NvmeStore, pages: np.ndarray, ranked: np.ndarray, bounds: list[tuple[int, int]],
             columns: dict[str, np.ndarray]) -> BatchHeaders:
    """The header writes of a batch of payload parts (``batch_headers``): each part packs
    its slots' headers on its I/O thread once its payloads landed, the last one writes
    them all; the pages go back to the store's cache once every write is done, and after
    any failure are not reused (a backend may report a write failed while another piece
    of it still reads the page: kvikio splits a write into tasks and reports the first
    error it meets)."""

    def pack(a: int, b: int) -> None:
        pack_headers(pages[a:b], {name: col[a:b] for name, col in columns.items()}, store.mac_key, ranked[a:b],
                     store.data_stride, store.slots_per_file)

    return BatchHeaders(store, pages, ranked, bounds, pack,
                        lambda all_landed: store.header_pages.give(pages, reuse=all_landed))


def read_rows(store: NvmeStore, slots: np.ndarray, rows: np.ndarray, idx: np.ndarray, lengths: np.ndarray,
              checksums: np.ndarray, parts: int = 1) -> list[tuple[np.ndarray, "Future[Failures]"]]:
    """Read slot ``slots[i]``'s payload into ``rows[idx[i]]`` and verify its first
    ``lengths[i]`` bytes against ``checksums[i]`` on the I/O thread that read it, in up
    to ``parts`` backend calls of consecutive slots. The result is each call's items
    (indices into ``slots``) and the future of their failures, in that order
    (``CorruptBlockError`` where the bytes do not match: they must not be served)."""
    slots, idx = _checked(store, slots, rows, idx, [lengths, checksums])
    n = slots.size
    if not _slot_rows(store, rows):
        return [(np.arange(n), store.read_checked([(int(slots[i]), rows[idx[i]], int(lengths[i]),
                                                    int(checksums[i])) for i in range(n)]))]
    order, ranked, files, offsets = _ranked(store, slots)
    handles, dst = store.handles, idx[order].tolist()
    sums = list(zip(np.asarray(lengths)[order].tolist(), np.asarray(checksums)[order].tolist()))
    out = []
    for a, b in _parts(n, parts):
        def check(i: int, a: int = a) -> None:  # where the compiled loop did not verify, or failed
            length, checksum = sums[a + i]
            if block_checksum(rows[dst[a + i]], length) != checksum:
                raise CorruptBlockError(f"NVMe slot {int(ranked[a + i])} failed its checksum")

        try:  # once a part is out, a later one's error is that part's failure, never a raise
            jobs = RowJobs(handles, rows, files[a:b], dst[a:b], offsets[a:b])
            out.append((order[a:b], store.backend.pread_checked(jobs, check, sums[a:b])))
        except Exception as e:
            out.append((order[a:b], _failed(e)))
    return out


class RowJobs(SequenceABC):
    """One part's jobs (handle, [row], offset), a slot each, made when read: the posix
    backend reads them on the I/O thread that runs the part, so a batch's per-block
    Python runs there a part at a time, beside the other threads' I/O, instead of on
    the mover before any of it starts (~1.5 ms for 256 blocks)."""

    __slots__ = ("handles", "rows", "files", "src", "offsets")

    def __init__(self, handles: list, rows: np.ndarray, files: list[int], src: list[int], offsets: list[int]) -> None:
        self.handles, self.rows, self.files, self.src, self.offsets = handles, rows, files, src, offsets

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> Job:  # type: ignore[override]  # items only: nothing slices a part
        return self.handles[self.files[i]], [self.rows[self.src[i]]], self.offsets[i]

    def __iter__(self) -> Iterator[Job]:
        handles, rows = self.handles, self.rows
        return ((handles[f], [rows[r]], off) for f, r, off in zip(self.files, self.src, self.offsets))


def _failed(e: BaseException) -> "Future[Failures]":
    """A part that could not be issued: its future fails with ``e`` (each of its items fails)."""
    f: "Future[Failures]" = Future()
    f.set_exception(e)
    return f


def _checked(store: NvmeStore, slots: np.ndarray, rows: Any, idx: np.ndarray,
             columns: list) -> tuple[np.ndarray, np.ndarray]:
    """``slots`` and ``idx`` as int64, once every column has one non-negative integer a slot
    and every row index is in range."""
    slots = np.asarray(slots, dtype=np.int64)
    idx = np.asarray(idx, dtype=np.int64)
    n = slots.size
    if idx.size != n or any(np.shape(c) != (n,) for c in columns):
        raise ValueError(f"nvme batch: {n} slots, but row indices or header fields of another length")
    for c in map(np.asarray, columns):  # a header field is an unsigned 64-bit integer: no wrapping, no truncation
        if c.dtype.kind not in "iub" or (c.dtype.kind == "i" and n and int(c.min()) < 0):
            raise ValueError(f"nvme batch: header fields must be non-negative integers, got {c.dtype} {c.min()}")
    if n and (int(idx.min()) < 0 or int(idx.max()) >= len(rows)):
        raise ValueError(f"nvme batch: a row index is out of range [0, {len(rows)})")
    return slots, idx


def _ranked(store: NvmeStore, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
    """(order, slots in ascending order, each one's file and payload offset): each thread's
    share is then one run of the disk. A slot named twice raises ValueError."""
    order = np.argsort(slots, kind="stable")
    ranked = slots[order]
    if ranked.size > 1 and bool((ranked[1:] == ranked[:-1]).any()):
        raise ValueError("nvme batch: a slot is named twice")  # whose header would describe which payload?
    files, offsets = store.layout.payload_offsets(ranked)
    return order, ranked, files.tolist(), offsets.tolist()


def _parts(n: int, parts: int) -> list[tuple[int, int]]:
    """[a, b) ranges of ``n`` items in up to ``parts`` parts, sizes within one of each other."""
    k = max(1, min(int(parts), n))
    bounds = [n * j // k for j in range(k + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _slot_rows(store: NvmeStore, rows: Any) -> bool:
    """Are ``rows`` (n, stride) uint8 rows, each a whole page-aligned slot for direct I/O?"""
    return (isinstance(rows, np.ndarray) and rows.ndim == 2 and rows.dtype == np.uint8
            and rows.shape[1] == store.data_stride and rows.strides[1] == 1 and rows.strides[0] % ALIGN == 0
            and rows.__array_interface__["data"][0] % ALIGN == 0)
