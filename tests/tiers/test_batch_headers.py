"""A batch's header writes (``tiers/batch_headers``): one write per run of consecutive
slots over the whole batch, issued once every part's payloads landed, by the last part
out or, where that part was lost, in a call of their own."""

from concurrent.futures import Future

import numpy as np
import pytest

from kvtier.kernels.checksum import block_checksum
from kvtier.tiers.aligned import aligned_empty
from kvtier.tiers.faults import FaultyBackend
from kvtier.tiers.io_backends import PosixBackend
from kvtier.tiers.nvme import NvmeStore
from kvtier.tiers.slab_layout import GROUP

from .test_nvme_batch import N_SLOTS, PER_FILE, STRIDE, _failures, _rows


@pytest.fixture
def posix():
    be = PosixBackend(threads=3)
    yield be
    be.shutdown()


class _Spy(FaultyBackend):
    """Records every write as (offset, header?) and, at each header write, whether every
    payload write issued so far had completed."""

    def __init__(self, inner, header_offsets: set[int]) -> None:
        super().__init__(inner)
        self.header_offsets, self.writes, self.payloads, self.headers_after_payloads = header_offsets, [], [], []

    def pwrite(self, handle, buffers, offset):
        header = offset in self.header_offsets
        self.writes.append((offset, header))
        if header:
            self.headers_after_payloads.append(all(f.done() for f in self.payloads))
        fut = super().pwrite(handle, buffers, offset)
        if not header:
            self.payloads.append(fut)
        return fut


@pytest.mark.parametrize("parts", [1, 4, 7])
def test_a_batch_writes_one_header_write_a_run_once_every_part_landed(posix, nvme_dir, parts):
    """However many parts the payloads go in, the headers go as one write per run of
    consecutive slots over the whole batch (here three: the slots cross a group's edge
    and a file's),
    and none before every payload of the batch completed; the slots recover exactly."""
    st = NvmeStore(nvme_dir, N_SLOTS, STRIDE, posix, PER_FILE)
    slots = np.arange(GROUP - 8, GROUP + 8)[::-1]
    spy = st.backend = _Spy(posix, {st.header_at(int(s))[1] for s in slots})
    rows = _rows(16, 21)
    idx = np.arange(16)[::-1]  # slot GROUP - 8 + j from row j
    f = {"key": np.arange(1, 17, dtype=np.uint64), "length": np.full(16, STRIDE),
         "checksum": np.array([block_checksum(rows[i]) for i in idx], dtype=np.uint64), "sealed": np.ones(16, bool),
         "seq": None, "owner": np.zeros(16, np.uint64)}
    parts_out = st.write_rows(slots, rows, idx, f, parts=parts)
    assert len(parts_out) == parts
    assert _failures(parts_out) == [None] * 16
    headers = [off for off, is_header in spy.writes if is_header]
    assert len(headers) == 3 and spy.headers_after_payloads == [True] * 3
    assert sum(not h for _, h in spy.writes) == 16
    st.backend = posix
    found, _ = st.recover()
    assert sorted(r.slot for r in found) == list(range(GROUP - 8, GROUP + 8))
    for r in found:
        out = aligned_empty(STRIDE)
        st.read(r.slot, out).result()
        assert np.array_equal(out, rows[r.slot - (GROUP - 8)])
    st.close()


class _LastPartLost:
    """Batch call ``which`` is lost once every earlier call has finished: refused (raises
    before any I/O) or failed as a whole (its future fails, its ``then`` never runs). The
    parts already done were not the last out, so the headers go in a call of their own."""

    def __init__(self, inner, which: int, how: str) -> None:
        self.inner, self.which, self.how, self.calls, self.out = inner, which, how, 0, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def pwrite_many(self, writes, then=None):
        self.calls += 1
        if self.calls != self.which:
            fut = self.inner.pwrite_many(writes, then)
            self.out.append(fut)
            return fut
        for fut in self.out:
            fut.result()
        if self.how == "refused":
            raise RuntimeError("cannot schedule new futures after shutdown")
        lost = Future()
        lost.set_exception(BufferError("the backend cannot take this buffer"))
        return lost


@pytest.mark.parametrize("how", ["refused", "failed"])
def test_when_the_last_part_is_lost_the_others_headers_still_go(posix, nvme_dir, how):
    st = NvmeStore(nvme_dir, N_SLOTS, STRIDE, posix, PER_FILE)
    rows = _rows(9, 12)
    slots = np.arange(9)
    f = {"key": np.arange(1, 10, dtype=np.uint64), "length": np.full(9, STRIDE),
         "checksum": np.array([block_checksum(r) for r in rows], dtype=np.uint64), "sealed": np.ones(9, bool),
         "seq": None, "owner": np.zeros(9, np.uint64)}
    lossy = st.backend = _LastPartLost(posix, 3, how)
    errors = _failures(st.write_rows(slots, rows, np.arange(9), f, parts=3))
    assert [e is not None for e in errors] == [False] * 6 + [True] * 3
    assert lossy.calls == 4  # three parts, then the headers of the two that landed
    assert st.header_pages.cached_pages == 0  # a part failed: no page is reused
    st.backend = posix
    assert sorted(r.slot for r in st.recover()[0]) == list(range(6))
    st.close()


def test_an_empty_batch_issues_nothing_and_keeps_no_page(posix, nvme_dir):
    st = NvmeStore(nvme_dir, N_SLOTS, STRIDE, posix, PER_FILE)
    empty = np.zeros(0, np.uint64)
    f = {"key": empty, "length": empty, "checksum": empty, "sealed": np.zeros(0, bool), "seq": None, "owner": empty}
    for _ in range(3):
        assert st.write_rows(np.zeros(0, np.int64), _rows(2, 1), np.zeros(0, np.int64), f, parts=4) == []
    assert not st.header_pages._lent  # every page taken was given back
    st.close()


def test_the_parts_resolve_even_when_giving_the_pages_back_fails(posix, nvme_dir, monkeypatch):
    """The last step of a batch runs in a future's done-callback, whose exceptions are
    only logged: it must not leave the mover waiting on a part for ever."""
    st = NvmeStore(nvme_dir, N_SLOTS, STRIDE, posix, PER_FILE)

    def broken(pages, reuse=True):
        raise MemoryError("injected")

    monkeypatch.setattr(st.header_pages, "give", broken)
    rows = _rows(6, 5)
    f = {"key": np.arange(1, 7, dtype=np.uint64), "length": np.full(6, STRIDE),
         "checksum": np.array([block_checksum(r) for r in rows], dtype=np.uint64), "sealed": np.ones(6, bool),
         "seq": None, "owner": np.zeros(6, np.uint64)}
    parts = st.write_rows(np.arange(6), rows, np.arange(6), f, parts=3)
    assert [fut.result(timeout=10) for _, fut in parts] == [[None, None]] * 3
    st.close()
