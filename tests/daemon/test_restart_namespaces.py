"""A restart gives every recovered block back to the namespace that sealed it, never to
whichever engine registers first: no other tenant names or finds it, no engine of another
block size gets it, and its own namespace finds it again (clean stop's index and crash scan)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvtier.daemon.config import load_config
from kvtier.daemon.service import Service
from kvtier.protocol import wire as P

from .service_calls import call, ids

BB = 4096


def _service(tmp_path) -> Service:
    cfg = load_config(environ={}, overrides=[
        f"tiers.hbm_bytes={8 * BB}", "tiers.dram_bytes=0", f"tiers.nvme_bytes={64 * BB}",
        f'tiers.nvme_dir="{tmp_path}/nvme"', 'tiers.io_backend="posix"', "tiers.io_threads=2",
        'policy.name="lru"', f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"])
    return Service(cfg)


def _keys(*k: int) -> bytes:
    return P.id_bytes(np.array(k, dtype=np.uint64), np.uint64)


def _sealed_on_nvme(svc: Service, engine: str, key: int, fill: int, nbytes: int) -> int:
    r = call(svc, "alloc", engine, n=1, seq=key, pin=True)
    b, slot = ids(r["blocks"])[0], ids(r["slots"])[0]
    svc.node.mgr.hbm.tensor[slot, :nbytes] = fill
    c = ids(call(svc, "seal", engine, blocks=[b], keys=_keys(key), seq=key)["blocks"])[0]
    call(svc, "release", engine, blocks=[c])
    m = svc.node.mgr
    m.demote([c], "hbm", "nvme"); m.wait()  # what eviction under HBM pressure does (while held: a
    call(svc, "free", engine, blocks=[c])  # block out of the index is released at its last free)
    return c


def _restart(svc: Service, tmp_path, scan: bool) -> Service:
    svc.close()
    if scan:  # as after a crash: no clean stop's index, the slot headers are read
        os.unlink(tmp_path / "nvme" / "slots.kvx")
    return _service(tmp_path)


@pytest.mark.parametrize("scan", [False, True], ids=["index", "scan"])
def test_a_recovered_block_is_its_tenant_s_not_the_first_engine_s(tmp_path, scan):
    svc = _service(tmp_path)
    call(svc, "register", "a", pid=0, block_bytes=BB, namespace="tenant-a")
    _sealed_on_nvme(svc, "a", 7, 0x5A, BB)
    svc = _restart(svc, tmp_path, scan)
    try:
        call(svc, "register", "x", pid=0, block_bytes=BB)  # the default namespace, first after the restart
        m = svc.node.mgr
        (b,) = np.flatnonzero(m.table.state == 2).tolist()  # the recovered block
        with pytest.raises(P.ProtocolError, match="unknown block"):
            call(svc, "acquire", "x", blocks=[b], timeout_s=1.0)  # it was served: tenant-a's bytes
        assert ids(call(svc, "ref", "x", keys=_keys(7))["blocks"]) == [-1]
        assert svc.stats()["io"]["recovered_unclaimed"] == 1
        call(svc, "register", "a2", pid=0, block_bytes=BB, namespace="tenant-a")
        assert svc.stats()["io"]["recovered_unclaimed"] == 0
        assert ids(call(svc, "ref", "a2", keys=_keys(7))["blocks"]) == [b]  # never found again before
        assert m.read(b) == bytes([0x5A]) * BB
        assert call(svc, "check", "a2") == {"ok": True}
    finally:
        svc.close()


@pytest.mark.parametrize("scan", [False, True], ids=["index", "scan"])
def test_a_recovered_block_goes_to_its_geometry_not_a_wider_engine(tmp_path, scan):
    """Both default-name engines; a restart gave the 2 KiB block to the 4 KiB engine that
    registered first: its ref hit, the slot's tail stale."""
    half = BB // 2
    svc = _service(tmp_path)
    call(svc, "register", "big", pid=0, block_bytes=BB)
    call(svc, "register", "small", pid=0, block_bytes=half)
    _sealed_on_nvme(svc, "small", 77, 3, half)
    svc = _restart(svc, tmp_path, scan)
    try:
        call(svc, "register", "big", pid=0, block_bytes=BB)
        assert ids(call(svc, "ref", "big", keys=_keys(77))["blocks"]) == [-1]
        call(svc, "register", "small", pid=0, block_bytes=half)
        (b,) = ids(call(svc, "ref", "small", keys=_keys(77))["blocks"])
        assert b >= 0 and svc.node.mgr.table.nbytes[b] == half and svc.node.mgr.read(b) == bytes([3]) * half
        assert ids(call(svc, "ref", "big", keys=_keys(77))["blocks"]) == [-1]
    finally:
        svc.close()


def test_unclaimed_blocks_keep_their_owner_through_another_clean_stop(tmp_path):
    """A restart in which the namespace never registers writes the index with the blocks'
    own owner: the run after hands them to their namespace still, to no one else."""
    svc = _service(tmp_path)
    call(svc, "register", "a", pid=0, block_bytes=BB, namespace="tenant-a")
    _sealed_on_nvme(svc, "a", 9, 0x33, BB)
    svc = _restart(svc, tmp_path, scan=False)
    call(svc, "register", "x", pid=0, block_bytes=BB)  # tenant-a does not come back this run
    svc = _restart(svc, tmp_path, scan=False)
    try:
        call(svc, "register", "x", pid=0, block_bytes=BB)
        assert ids(call(svc, "ref", "x", keys=_keys(9))["blocks"]) == [-1]
        call(svc, "register", "a", pid=0, block_bytes=BB, namespace="tenant-a")
        (b,) = ids(call(svc, "ref", "a", keys=_keys(9))["blocks"])
        assert b >= 0 and svc.node.mgr.read(b) == bytes([0x33]) * BB
    finally:
        svc.close()


def test_a_new_geometry_of_a_name_takes_a_key_an_unclaimed_block_held(tmp_path):
    """After a restart with another block size under one name (a new KV dtype), the old size's
    recovered blocks wait unclaimed under keys the new engine seals again: its blocks are
    indexed (they were kept out of the index, its own refs missing, until NVMe evicted the
    old ones), and it keeps its pins through the seal."""
    half = BB // 2
    svc = _service(tmp_path)
    call(svc, "register", "old", pid=0, block_bytes=BB, namespace="m")
    _sealed_on_nvme(svc, "old", 42, 1, BB)
    svc = _restart(svc, tmp_path, scan=False)
    try:
        call(svc, "register", "x", pid=0, block_bytes=BB)  # sizes the slots as before: the slabs are read
        call(svc, "register", "new", pid=0, block_bytes=half, namespace="m")
        assert svc.stats()["io"]["recovered_unclaimed"] == 1
        r = call(svc, "alloc", "new", n=1, seq=42, pin=True)
        b, slot = ids(r["blocks"])[0], ids(r["slots"])[0]
        svc.node.mgr.hbm.tensor[slot, :half] = 2
        assert ids(call(svc, "seal", "new", blocks=[b], keys=_keys(42), seq=42)["blocks"]) == [b]
        assert svc.node.mgr.table.pins[b] == 1
        call(svc, "release", "new", blocks=[b])
        assert ids(call(svc, "ref", "new", keys=_keys(42))["blocks"]) == [b]
        assert call(svc, "check", "new") == {"ok": True}
    finally:
        svc.close()


@pytest.mark.parametrize("scan", [False, True], ids=["index", "scan"])
def test_a_block_kept_out_of_the_index_never_comes_back_over_the_indexed_one(tmp_path, scan):
    """Two geometries of one name seal key 42: the second's block is kept out of the key index,
    but its NVMe header named the key with a newer sequence, so a crash scan brought it back
    and dropped the indexed block. Its copy is now written as not sealed: scans discard it."""
    half = BB // 2
    svc = _service(tmp_path)
    call(svc, "register", "big", pid=0, block_bytes=BB, namespace="m")
    call(svc, "register", "small", pid=0, block_bytes=half, namespace="m")
    _sealed_on_nvme(svc, "big", 42, 0x11, BB)
    _sealed_on_nvme(svc, "small", 42, 0x22, half)  # unindexed, its NVMe copy newer
    svc = _restart(svc, tmp_path, scan)
    try:
        call(svc, "register", "big", pid=0, block_bytes=BB, namespace="m")
        (b,) = ids(call(svc, "ref", "big", keys=_keys(42))["blocks"])
        assert b >= 0 and svc.node.mgr.read(b) == bytes([0x11]) * BB
        assert svc.stats()["io"]["recovered_unclaimed"] == 0
    finally:
        svc.close()


@pytest.mark.parametrize("errno_, code", [(28, P.NO_SPACE), (5, P.IO_ERROR)])
def test_a_clear_the_disk_refuses_is_an_io_error_and_drops_nothing(tmp_path, monkeypatch, errno_, code):
    """``clear`` voids the NVMe headers (a new key file) before it drops anything: a disk that
    refuses it answers ``no_space`` or ``io_error`` (not ``internal``, a bug's code), and every
    block stays; the next clear, with the disk back, drops them."""
    import kvtier.tiers.slab_state as slab_state

    svc = _service(tmp_path)
    try:
        call(svc, "register", "a", pid=0, block_bytes=BB, namespace="tenant-a")
        b = _sealed_on_nvme(svc, "a", 7, 0x5A, BB)

        def refused(src, dst):
            raise OSError(errno_, os.strerror(errno_))
        monkeypatch.setattr(slab_state.os, "replace", refused)
        with pytest.raises(P.ProtocolError) as ei:
            call(svc, "clear", "a")
        monkeypatch.undo()
        assert ei.value.code == code and "nothing was dropped" in str(ei.value)
        assert ids(call(svc, "lookup", "a", keys=_keys(7))["blocks"]) == [b]
        assert call(svc, "clear", "a")["dropped"] == 1
    finally:
        svc.close()


def test_a_clear_that_cannot_drain_its_transfers_is_a_timeout_and_drops_nothing(tmp_path, monkeypatch):
    """Transfers to a disk too slow to finish within the clear's drain time: ``timeout`` (not
    ``io_error``, though a TimeoutError is an OSError), nothing dropped, and a retry works."""
    svc = _service(tmp_path)
    try:
        call(svc, "register", "a", pid=0, block_bytes=BB, namespace="tenant-a")
        b = _sealed_on_nvme(svc, "a", 7, 0x5A, BB)
        mgr = svc.node.mgr
        slow = mgr.wait

        def stuck(timeout=None):  # the fault: a transfer that outlasts the drain time
            raise TimeoutError("1 transfers still pending")
        monkeypatch.setattr(mgr, "wait", stuck)
        with pytest.raises(P.ProtocolError) as ei:
            call(svc, "clear", "a")
        assert ei.value.code == P.TIMEOUT and "nothing was dropped" in str(ei.value)
        assert ids(call(svc, "lookup", "a", keys=_keys(7))["blocks"]) == [b]
        monkeypatch.setattr(mgr, "wait", slow)
        assert call(svc, "clear", "a")["dropped"] == 1
    finally:
        svc.close()
