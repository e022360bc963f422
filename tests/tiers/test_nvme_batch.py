"""Batched NVMe slot I/O from a pool's rows (``nvme_batch.write_rows``/``read_rows``): the
same bytes on disk, the same failures and the same verification as the per-block
``write_many``/``read_checked``, with headers packed as arrays on the I/O threads."""

import os

import numpy as np
import pytest

from kvtier.kernels.checksum import block_checksum
from kvtier.tiers.aligned import aligned_empty
from kvtier.tiers.faults import FaultyBackend
from kvtier.tiers.io_backends import PosixBackend
from kvtier.tiers.nvme import NvmeStore
from kvtier.tiers.nvme_batch import RowJobs
from kvtier.tiers.slab_layout import GROUP, HEADER_BYTES, SlabLayout
from kvtier.tiers.types import CorruptBlockError

STRIDE = 8192
PER_FILE = GROUP + 6  # a full group and a partial one a file: runs break at groups and files
N_SLOTS = 2 * PER_FILE


@pytest.fixture
def posix():
    be = PosixBackend(threads=3)
    yield be
    be.shutdown()


def _rows(n: int, seed: int) -> np.ndarray:
    rows = aligned_empty(n * STRIDE).reshape(n, STRIDE)
    rows[:] = np.random.default_rng(seed).integers(0, 255, rows.shape, dtype=np.uint8)
    return rows


def _batch(rng: np.random.Generator, n: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
    """``n`` distinct slots in random order (around group and file edges), their rows and header fields."""
    edges = np.array([GROUP - 3, GROUP - 2, GROUP - 1, GROUP, GROUP + 1, PER_FILE - 1, PER_FILE, PER_FILE + 1])
    slots = rng.permutation(np.unique(np.concatenate([edges, rng.choice(N_SLOTS, n, replace=False)])))[:n]
    idx = rng.choice(len(rows), n, replace=False)
    lengths = rng.integers(1, STRIDE + 1, n)
    fields = {"key": rng.integers(1, 2**63, n, dtype=np.uint64), "length": lengths,
              "checksum": np.array([block_checksum(rows[i], int(ln)) for i, ln in zip(idx, lengths)], dtype=np.uint64),
              "sealed": rng.random(n) < 0.7, "seq": np.arange(100, 100 + n, dtype=np.uint64),
              "owner": rng.integers(0, 2**32, n, dtype=np.uint64)}
    return slots, idx, fields


def _slabs(directory: str) -> list[bytes]:
    return [open(os.path.join(directory, f), "rb").read() for f in sorted(os.listdir(directory)) if f.endswith(".kvt")]


def _failures(parts) -> list:
    out: dict[int, object] = {}
    for items, fut in parts:
        try:
            failures = fut.result()
        except Exception as e:  # a part that failed as a whole fails each of its items
            failures = [e] * len(items)
        for i, err in zip(items.tolist(), failures):
            assert i not in out  # every item is in exactly one part
            out[i] = err
    return [out[i] for i in range(len(out))]


@pytest.mark.parametrize("seed", range(4))
def test_write_rows_puts_on_disk_exactly_the_bytes_write_many_does(posix, tmp_path, seed):
    """The same batch through both ways into two stores with the same MAC key: the slab
    files are equal byte for byte (payloads, headers, and the zeros between), whatever
    the order of the slots and however many parts the rows go in."""
    rng = np.random.default_rng(seed)
    rows = _rows(64, seed)
    a, b = NvmeStore(str(tmp_path / "a"), N_SLOTS, STRIDE, posix, PER_FILE), \
        NvmeStore(str(tmp_path / "b"), N_SLOTS, STRIDE, posix, PER_FILE)
    try:
        b.mac_key, b.seq = a.mac_key, a.seq  # the same key and next sequence: the same headers
        for batch in range(3):
            slots, idx, f = _batch(rng, int(rng.integers(1, 40)), rows)
            if batch == 2:
                f["seq"] = None  # each store takes its next sequence numbers, in slot order
            items = [(int(s), rows[i], int(f["key"][j]), int(f["length"][j]), int(f["checksum"][j]),
                      bool(f["sealed"][j]), None if f["seq"] is None else int(f["seq"][j]), int(f["owner"][j]))
                     for j, (s, i) in enumerate(zip(slots, idx))]
            assert a.write_many(items).result() == [None] * len(items)
            parts = b.write_rows(slots, rows, idx, f, parts=1 + batch * 3)
            assert len(parts) == min(len(items), 1 + batch * 3)
            assert _failures(parts) == [None] * len(items)
            assert _slabs(str(tmp_path / "a")) == _slabs(str(tmp_path / "b"))
        found_a, _ = a.recover()
        found_b, _ = b.recover()
        assert found_a == found_b and found_a
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("parts", [1, 3])
def test_each_failed_payload_fails_alone_and_keeps_its_old_header(posix, nvme_dir, parts):
    """Injected write errors hit single payloads: exactly those items fail, in whichever
    part they were; every other slot's payload and header land and recover."""
    st = NvmeStore(nvme_dir, N_SLOTS, STRIDE, posix, PER_FILE)
    rows = _rows(16, 3)
    slots = np.array([9, 3, 4, 5, 6, 7, 8, 2])
    f = {"key": np.arange(200, 208, dtype=np.uint64), "length": np.full(8, STRIDE),
         "checksum": np.array([block_checksum(rows[i]) for i in range(8)], dtype=np.uint64),
         "sealed": np.ones(8, bool), "seq": np.arange(1, 9, dtype=np.uint64), "owner": np.zeros(8, np.uint64)}
    st.backend = FaultyBackend(posix, fail_writes=2, mode="eio")  # the first two payloads issued fail
    errors = _failures(st.write_rows(slots, rows, np.arange(8), f, parts=parts))
    st.backend = posix
    # payloads go in slot order: slots 2 and 3 (items 7 and 1) were the first two
    assert [e is not None for e in errors] == [False, True, False, False, False, False, False, True]
    assert all(isinstance(e, OSError) for e in errors if e is not None)
    assert st.read_header(2) is None and st.read_header(3) is None  # no header without its payload
    found, _ = st.recover()
    assert sorted(r.slot for r in found) == [4, 5, 6, 7, 8, 9]
    for r in found:
        out = aligned_empty(STRIDE)
        st.read(r.slot, out).result()
        j = int(np.flatnonzero(slots == r.slot)[0])
        assert r.header.key == 200 + j and np.array_equal(out, rows[j])
    st.close()


class _FailingHeaders(FaultyBackend):
    """Fails the header writes (offsets inside a group's header span), nothing else."""

    def __init__(self, inner, layout: SlabLayout) -> None:
        super().__init__(inner, mode="eio")
        self.layout = layout

    def pwrite(self, handle, buffers, offset):
        if offset % self.layout.group_bytes < GROUP * HEADER_BYTES:
            self.fail_writes = 1
        return super().pwrite(handle, buffers, offset)


def test_a_failed_header_run_fails_every_slot_in_it(posix, nvme_dir):
    """Payloads land but their header write fails: each slot of that run fails (its
    block is not on disk as far as a restart can tell), in every part."""
    st = NvmeStore(nvme_dir, N_SLOTS, STRIDE, posix, PER_FILE)
    rows = _rows(6, 8)
    slots = np.array([GROUP + 1, 1, 2, GROUP, 3, 40])  # runs: 1-3, 40, GROUP..GROUP+1
    f = {"key": np.arange(1, 7, dtype=np.uint64), "length": np.full(6, STRIDE),
         "checksum": np.zeros(6, np.uint64), "sealed": np.ones(6, bool), "seq": None, "owner": np.zeros(6, np.uint64)}
    st.backend = _FailingHeaders(posix, st.layout)
    errors = _failures(st.write_rows(slots, rows, np.arange(6), f, parts=2))
    assert all(isinstance(e, OSError) for e in errors)
    assert st.header_pages.cached_pages == 0  # after a failure no page is reused
    st.backend = posix
    f["seq"] = None
    assert _failures(st.write_rows(slots, rows, np.arange(6), f, parts=2)) == [None] * 6
    assert st.header_pages.cached_pages > 0  # every write done and none failed: the pages are reused
    st.close()


def test_bad_batches_raise_before_any_io(posix, nvme_dir):
    st = NvmeStore(nvme_dir, N_SLOTS, STRIDE, posix, PER_FILE)
    rows = _rows(4, 4)
    f = {"key": np.arange(1, 4, dtype=np.uint64), "length": np.full(3, STRIDE),
         "checksum": np.zeros(3, np.uint64), "sealed": np.ones(3, bool), "seq": None, "owner": np.zeros(3, np.uint64)}
    before = _slabs(nvme_dir)
    seq = st.seq
    for slots, idx, fields, what in [
        (np.array([1, 2, 1]), np.arange(3), f, "named twice"),
        (np.array([1, 2, 3]), np.array([0, 1, 4]), f, "out of range"),
        (np.array([1, 2, N_SLOTS]), np.arange(3), f, "out of range"),
        (np.array([1, 2]), np.arange(2), f, "another length"),
    ]:
        with pytest.raises(ValueError, match=what):
            st.write_rows(slots, rows, idx, fields, parts=2)
    with pytest.raises(ValueError, match="out of range"):
        st.read_rows(np.array([0, 1]), rows, np.array([0, 9]), np.full(2, STRIDE), np.zeros(2, np.uint64))
    assert _slabs(nvme_dir) == before and st.header_pages.cached_pages == 0
    assert st.seq == seq  # no sequence number taken by a refused batch
    st.close()


def test_rows_that_are_not_whole_aligned_slots_go_block_by_block(posix, nvme_dir):
    """Rows narrower than the stride, or not page aligned, still land (bounced) and read back."""
    st = NvmeStore(nvme_dir, N_SLOTS, 6000, posix, PER_FILE)  # stride 8192, rows of 6000 bytes
    rows = np.random.default_rng(5).integers(0, 255, (5, 6000), dtype=np.uint8)
    f = {"key": np.arange(1, 6, dtype=np.uint64), "length": np.full(5, 6000),
         "checksum": np.array([block_checksum(r) for r in rows], dtype=np.uint64), "sealed": np.ones(5, bool),
         "seq": None, "owner": np.zeros(5, np.uint64)}
    assert _failures(st.write_rows(np.array([7, 3, 5, 1, 0]), rows, np.arange(5), f, parts=3)) == [None] * 5
    back = _rows(5, 0)
    errs = _failures(st.read_rows(np.array([7, 3, 5, 1, 0]), back, np.arange(5), f["length"], f["checksum"], 2))
    assert errs == [None] * 5 and np.array_equal(back[:, :6000], rows)
    st.close()


@pytest.mark.parametrize("parts", [1, 2, 5])
def test_read_rows_lands_exact_bytes_and_refuses_only_the_corrupt_block(posix, nvme_dir, parts):
    st = NvmeStore(nvme_dir, N_SLOTS, STRIDE, posix, PER_FILE)
    rows = _rows(12, 6)
    slots = np.array([GROUP + 2, 4, GROUP - 1, 0, PER_FILE, 9, GROUP, 1, 2, 3])
    n = slots.size
    f = {"key": np.arange(1, n + 1, dtype=np.uint64), "length": np.full(n, STRIDE),
         "checksum": np.array([block_checksum(rows[i]) for i in range(n)], dtype=np.uint64),
         "sealed": np.ones(n, bool), "seq": None, "owner": np.zeros(n, np.uint64)}
    assert _failures(st.write_rows(slots, rows, np.arange(n), f, parts=parts)) == [None] * n
    handle, off = st.payload_at(int(slots[4]))  # flip one byte of item 4's payload on disk
    path = os.path.join(nvme_dir, f"slab-{int(slots[4]) // PER_FILE:04d}.kvt")
    with open(path, "r+b") as fh:
        fh.seek(off + 77)
        byte = fh.read(1)[0]
        fh.seek(off + 77)
        fh.write(bytes([byte ^ 0x10]))
    back = np.zeros((n + 2, STRIDE), dtype=np.uint8)
    back = aligned_empty(back.nbytes).reshape(back.shape)
    back[:] = 0
    dst = np.arange(n)[::-1] + 2  # rows land where idx says, not in slot order
    errors = _failures(st.read_rows(slots, back, dst, f["length"], f["checksum"], parts))
    assert [e is not None for e in errors] == [i == 4 for i in range(n)]
    assert isinstance(errors[4], CorruptBlockError) and f"slot {int(slots[4])}" in str(errors[4])
    for i in range(n):
        if i != 4:
            assert np.array_equal(back[dst[i]], rows[i])
    assert not back[:2].any()
    st.close()


class _RefusesSecondCall:
    """A backend whose second batch call raises before any I/O (a pool shut down under
    it): the first part is already out and must still be waited for and reported."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _count(self) -> None:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("cannot schedule new futures after shutdown")

    def pwrite_many(self, writes, then=None):
        self._count()
        return self.inner.pwrite_many(writes, then)

    def pread_checked(self, reads, check, sums=None):
        self._count()
        return self.inner.pread_checked(reads, check, sums)


def test_a_part_that_cannot_be_issued_fails_alone_and_the_parts_already_out_are_kept(posix, nvme_dir):
    """Part 2 of 3 is refused: its items fail with the backend's error, parts 1 and 3
    land (headers too), and nothing raises, so no caller frees the slots of writes or
    reads still in flight."""
    st = NvmeStore(nvme_dir, N_SLOTS, STRIDE, posix, PER_FILE)
    rows = _rows(9, 9)
    slots = np.array([8, 0, 7, 1, 6, 2, 5, 3, 4])
    f = {"key": np.arange(1, 10, dtype=np.uint64), "length": np.full(9, STRIDE),
         "checksum": np.array([block_checksum(r) for r in rows], dtype=np.uint64), "sealed": np.ones(9, bool),
         "seq": None, "owner": np.zeros(9, np.uint64)}
    st.backend = _RefusesSecondCall(posix)
    parts = st.write_rows(slots, rows, np.arange(9), f, parts=3)
    errors = _failures(parts)
    assert [e is not None for e in errors] == [s in (3, 4, 5) for s in slots]  # the second part: slots 3-5
    assert all("shutdown" in str(e) for e in errors if e is not None)
    st.backend = posix
    assert sorted(r.slot for r in st.recover()[0]) == [0, 1, 2, 6, 7, 8]
    back = aligned_empty(9 * STRIDE).reshape(9, STRIDE)
    st.backend = _RefusesSecondCall(posix)
    keep = np.array([1, 3, 5, 4, 2, 0])  # the items whose slots landed: 0, 1, 2, 6, 7, 8
    errors = _failures(st.read_rows(slots[keep], back, keep, f["length"][keep], f["checksum"][keep], parts=3))
    assert [e is not None for e in errors] == [s in (2, 6) for s in slots[keep]]  # the second part: slots 2, 6
    for i, e in zip(keep, errors):
        if e is None:
            assert np.array_equal(back[i], rows[i])
    st.close()


def test_header_fields_that_would_wrap_or_truncate_are_refused(posix, nvme_dir):
    st = NvmeStore(nvme_dir, N_SLOTS, STRIDE, posix, PER_FILE)
    rows = _rows(2, 10)
    good = {"key": np.array([1, 2], np.uint64), "length": np.full(2, STRIDE), "checksum": np.zeros(2, np.uint64),
            "sealed": np.ones(2, bool), "seq": None, "owner": np.zeros(2, np.uint64)}
    seq = st.seq
    for name, bad in [("seq", np.array([1, -2])), ("length", np.array([2.7, 3.0])), ("key", np.array([-1, 1]))]:
        with pytest.raises(ValueError, match="non-negative integers"):
            st.write_rows(np.array([0, 1]), rows, np.arange(2), {**good, name: bad})
    with pytest.raises(OverflowError):  # the per-block way refuses such a header as well, before any I/O
        st.write_many([(0, rows[0], -1, STRIDE, 0, True, 1), (1, rows[1], 2, STRIDE, 0, True, 2)])
    with pytest.raises(ValueError, match="missing"):
        st.write_rows(np.array([0, 1]), rows, np.arange(2), {k: v for k, v in good.items() if k != "owner"})
    assert st.seq == seq and st.read_header(0) is None
    st.close()


def test_the_block_by_block_path_fails_only_the_block_whose_source_fails(posix, nvme_dir):
    """Where the source is no host array (a device pool staged through host memory), a
    block whose staging fails fails alone, and an open block is staged once: its
    checksum is of the very bytes written."""
    import threading
    import types
    from collections import Counter

    from kvtier.tiers.paths import _write_nvme
    from kvtier.tiers.transfer import Transfer
    from kvtier.tiers.types import Tier

    st = NvmeStore(nvme_dir, 64, STRIDE, posix, PER_FILE)
    rows = _rows(4, 11)
    staged = Counter()

    def source(slot: int) -> np.ndarray:
        staged[slot] += 1
        if slot == 1:
            raise RuntimeError("staging copy failed")
        out = aligned_empty(STRIDE)
        out[:] = rows[slot]
        return out

    t = Transfer(1, Tier.HBM, Tier.NVME, np.arange(100, 104), np.arange(4), np.arange(10, 14),
                 np.arange(1, 5, dtype=np.uint64), np.full(4, STRIDE),
                 np.array([block_checksum(rows[0]), block_checksum(rows[1]), 0, 0], dtype=np.uint64),
                 np.array([True, True, False, False]), seqs=np.arange(1, 5, dtype=np.uint64),
                 owners=np.zeros(4, np.uint64))
    m = types.SimpleNamespace(nvme=st, tls=threading.local())
    ok, errors = np.zeros(4, bool), {}
    sums = _write_nvme(m, t, ok, errors, source)
    assert ok.tolist() == [True, False, True, True] and list(errors) == [101] and "staging" in errors[101]
    assert staged == {0: 1, 1: 1, 2: 1, 3: 1}
    assert sums[2:].tolist() == [block_checksum(rows[2]), block_checksum(rows[3])]
    st.close()


def test_a_batchs_per_block_work_runs_on_the_io_threads_not_the_callers(nvme_dir, monkeypatch):
    """With the one I/O thread held, ``write_rows`` and ``read_rows`` return having read no
    part's jobs and made no byte view of any block (the caller's thread holds the GIL
    for none of that work);
    released, every view is made on the I/O thread, and the bytes land and verify."""
    import threading

    be = PosixBackend(threads=1)
    made: list[str] = []
    real = PosixBackend._views  # a staticmethod: the plain function

    def spy(buffers, into=False):
        made.append(threading.current_thread().name)
        return real(buffers, into)

    monkeypatch.setattr(PosixBackend, "_views", staticmethod(spy))
    rows_read = RowJobs.__iter__

    def spy_rows(self):
        made.append("rows:" + threading.current_thread().name)
        return rows_read(self)

    monkeypatch.setattr(RowJobs, "__iter__", spy_rows)
    st = NvmeStore(nvme_dir, N_SLOTS, STRIDE, be, PER_FILE)
    gate = threading.Event()
    try:
        be._pool.submit(gate.wait)  # the pool's one thread is busy until the gate opens
        rows = _rows(8, 11)
        n = rows.shape[0]
        slots = np.arange(GROUP - 4, GROUP + 4)  # across a header-run break
        f = {"key": np.arange(1, n + 1, dtype=np.uint64), "length": np.full(n, STRIDE),
             "checksum": np.array([block_checksum(r) for r in rows], dtype=np.uint64),
             "sealed": np.ones(n, bool), "seq": None, "owner": np.zeros(n, np.uint64)}
        writes = st.write_rows(slots, rows, np.arange(n), f, parts=2)
        assert made == [] and not any(fut.done() for _, fut in writes)
        gate.set()
        assert _failures(writes) == [None] * n
        assert made and all(name.removeprefix("rows:").startswith("kvtier-io") for name in made)
        assert sum(name.startswith("rows:") for name in made) == 2  # both parts' jobs were read lazily
        made.clear()
        gate.clear()
        be._pool.submit(gate.wait)
        back = aligned_empty(rows.nbytes).reshape(rows.shape)
        back[:] = 0
        reads = st.read_rows(slots, back, np.arange(n)[::-1], f["length"], f["checksum"], parts=2)
        assert made == [] and not any(fut.done() for _, fut in reads)
        gate.set()
        assert _failures(reads) == [None] * n
        assert np.array_equal(back[::-1], rows)
        assert made and all(name.removeprefix("rows:").startswith("kvtier-io") for name in made)
        assert sum(name.startswith("rows:") for name in made) == 2
    finally:
        gate.set()
        st.close()
        be.shutdown()
