"""What an acquire is told stays true, and a block that cannot be read gives its key up.

An in-process ``Service`` over real pools and slab files, driven turn by turn as the
server's owner loop drives it; the disk fails through ``FaultyBackend``.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.daemon.config import load_config
from kvtier.daemon.service import Service
from kvtier.protocol import wire as P
from kvtier.tiers.integrity import MAX_READ_FAILURES
from kvtier.tiers.types import DRAM, HBM, NVME

from .service_calls import call, ids

BB = 4096


def _service(tmp_path, hbm: int, dram: int, nvme: int, *extra: str) -> Service:
    cfg = load_config(environ={}, overrides=[
        f"tiers.hbm_bytes={hbm * BB}", f"tiers.dram_bytes={dram * BB}", f"tiers.nvme_bytes={nvme * BB}",
        f'tiers.nvme_dir="{tmp_path}/nvme"', f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false",
        *extra])
    return Service(cfg)


def _tick(svc: Service) -> list:
    """One turn of the owner loop, as ``Server._tick`` runs it."""
    svc.background()
    out = svc.advance()
    svc.maintain()
    return out


def _sealed(svc: Service, engine: str, key: int, fill: int, seq: int = 0) -> int:
    r = call(svc, "alloc", engine, n=1, seq=seq, pin=True)
    b, slot = ids(r["blocks"])[0], ids(r["slots"])[0]
    svc.node.mgr.hbm.host_view(slot)[:] = fill
    c = ids(call(svc, "seal", engine, blocks=[b], keys=P.id_bytes(np.array([key], dtype=np.uint64), np.uint64))
            ["blocks"])[0]
    call(svc, "release", engine, blocks=[c])
    return c


@pytest.fixture
def tenants(tmp_path):
    """Engines A and B in namespaces of their own, reading promotions layer by layer."""
    svc = _service(tmp_path, hbm=4, dram=8, nvme=16)
    for engine, ns in (("A", "tenant-a"), ("B", "tenant-b")):
        call(svc, "register", engine, pid=0, block_bytes=BB, namespace=ns, layout={"layers": 4})
    yield svc
    svc.close()


def _to_dram(svc: Service, *blocks: int) -> None:
    svc.node.mgr.demote(list(blocks), HBM, DRAM)
    svc.node.mgr.wait()
    _tick(svc)


def test_a_slot_reported_to_a_layer_wise_acquire_is_never_given_to_another_block(tenants):
    """B is told every layer of Y landed in slot S. In the same owner-loop turn, A's earlier
    acquire needed a slot: it evicted Y (landed, not pinned yet) and promoted tenant-a's X
    into S, so B read tenant-a's bytes as Y's KV."""
    svc = tenants
    mgr = svc.node.mgr
    x, y = _sealed(svc, "A", 1, 0xAA), _sealed(svc, "B", 2, 0xBB)
    _to_dram(svc, x, y)
    call(svc, "alloc", "A", n=3, seq=5, pin=True)  # A's running sequence: one HBM slot left
    mgr.demote([x], DRAM, NVME)  # a watermark demotion moves X on to the disk
    call(svc, "acquire", "A", blocks=[x], timeout_s=30, wait=True)  # waits: X is moving
    ticket = call(svc, "acquire", "B", blocks=[y], timeout_s=30, wait=False)["ticket"]
    mgr.mover.drain()  # both transfers done on the mover threads, applied in one turn
    r = call(svc, "acquire_poll", "B", ticket=ticket)
    told = {i: s for i, (n, s) in enumerate(zip(ids(r["layers_ready"]), ids(r["slots"]))) if n > 0}
    for _ in range(3):
        _tick(svc)
        mgr.wait()
    for slot in told.values():  # whatever B was told it may read is still Y's
        assert int(mgr.table.slot_owner[HBM][slot]) == y
        assert bool((mgr.hbm.host_view(slot) == 0xBB).all())
    r = call(svc, "acquire_poll", "B", ticket=ticket)
    assert r["done"] and bool((mgr.hbm.host_view(ids(r["slots"])[0]) == 0xBB).all())
    assert call(svc, "check", "x")["ok"]


@pytest.fixture
def faulty(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_FAULTS", "mode=eio")
    svc = _service(tmp_path, 4, 4, 16, 'tiers.io_backend="faulty"')
    call(svc, "register", "A", pid=0, block_bytes=BB, namespace="m")
    yield svc
    svc.close()


def _unreadable(svc: Service, key: int) -> int:
    """A sealed block on NVMe only, whose reads failed for as many promotions as the limit
    (each promotion reads, then reads once more): its acquire got ``io_error``."""
    mgr = svc.node.mgr
    k = _sealed(svc, "A", key, 0xAA, seq=1)
    mgr.demote([k], HBM, NVME)
    mgr.wait()
    mgr.backend.fail_reads = 2 * MAX_READ_FAILURES
    ticket = call(svc, "acquire", "A", blocks=[k], timeout_s=30, wait=False)["ticket"]
    with pytest.raises(P.ProtocolError) as e:
        for _ in range(50):
            mgr.wait()
            _tick(svc)
            call(svc, "acquire_poll", "A", ticket=ticket)
    assert e.value.code == "io_error" and mgr.backend.fail_reads == 0  # the disk is well again
    return k


def test_a_block_whose_reads_keep_failing_gives_its_key_to_a_fresh_seal(faulty):
    """A burst of read errors used to leave the key on a block no acquire would read again,
    and the engine's recomputed seal of the key folded into it: unservable for good."""
    svc = faulty
    mgr = svc.node.mgr
    k = _unreadable(svc, 7)
    assert ids(call(svc, "lookup", "A", keys=P.id_bytes(np.array([7], dtype=np.uint64), np.uint64))["blocks"]) == [-1]
    fresh = _sealed(svc, "A", 7, 0xAC, seq=2)  # the engine recomputed it
    assert fresh != k
    r = call(svc, "acquire", "A", blocks=[fresh], wait=False)
    assert r["done"] and bool((mgr.hbm.host_view(ids(r["slots"])[0]) == 0xAC).all())
    assert call(svc, "check", "x")["ok"]


def test_failed_write_backs_never_make_a_readable_block_unservable(faulty):
    svc = faulty
    mgr = svc.node.mgr
    k = _sealed(svc, "A", 8, 0xAB, seq=1)
    mgr.demote([k], HBM, DRAM)
    mgr.wait()
    mgr.backend.fail_writes = MAX_READ_FAILURES + 1
    for _ in range(MAX_READ_FAILURES + 1):  # the disk refuses every write-back: DRAM keeps its copy
        mgr.demote([k], DRAM, NVME)
        mgr.wait()
    assert mgr.counters["errors_dram->nvme"] == MAX_READ_FAILURES + 1 and mgr.table.has_copy(k, DRAM)
    ticket = call(svc, "acquire", "A", blocks=[k], timeout_s=30, wait=False)["ticket"]
    for _ in range(20):
        mgr.wait()
        _tick(svc)
        r = call(svc, "acquire_poll", "A", ticket=ticket)
        if r["done"]:
            break
    assert r["done"] and bool((mgr.hbm.host_view(ids(r["slots"])[0]) == 0xAB).all())
    assert call(svc, "check", "x")["ok"]


def test_a_hint_whose_block_was_freed_promotes_nothing_else(tmp_path):
    """The prefetcher held bare ids: a hinted block dropped from the cache, its id taken by
    another tenant's block, and the hint promoted that one instead (a copy for nobody)."""
    svc = _service(tmp_path, 4, 4, 0, "tiers.max_blocks=1")  # one id: a freed one is reused at once
    try:
        for engine, ns in (("A", "tenant-a"), ("B", "tenant-b")):
            call(svc, "register", engine, pid=0, block_bytes=BB, namespace=ns)
        mgr = svc.node.mgr
        k = _sealed(svc, "A", 3, 0xAA)
        mgr.demote([k], HBM, DRAM)
        mgr.wait()
        call(svc, "hint", "A", blocks=[k], deadline_s=30.0)
        call(svc, "free", "A", blocks=[k])
        call(svc, "clear", "x")  # the cached block is dropped: its id is free
        other = _sealed(svc, "B", 4, 0xBB)
        assert other == k  # the id went to tenant-b's block
        mgr.demote([other], HBM, DRAM)
        mgr.wait()
        for _ in range(5):
            _tick(svc)
            mgr.wait()
        assert not mgr.table.has_copy(other, HBM) and svc.node.prefetcher.started == 0
        assert call(svc, "check", "x")["ok"]
    finally:
        svc.close()


def test_an_engine_of_another_geometry_is_polled_in_the_parts_register_told_it(tmp_path):
    """Register tells an engine whose layers differ from the first engine's that it reads
    whole blocks (1 part); its polls counted the first engine's layers."""
    svc = _service(tmp_path, 4, 4, 0)
    try:
        call(svc, "register", "A", pid=0, block_bytes=BB, namespace="m", layout={"layers": 4})
        told = call(svc, "register", "B", pid=0, block_bytes=BB, namespace="n", layout={"layers": 2})
        assert told["layers"] == 1
        mgr = svc.node.mgr
        y = _sealed(svc, "B", 5, 0xBB)
        _to_dram(svc, y)
        ticket = call(svc, "acquire", "B", blocks=[y], wait=False)["ticket"]
        mgr.mover.drain()  # landed, not applied: the poll reports progress, not a pin
        r = call(svc, "acquire_poll", "B", ticket=ticket)
        assert r["layers"] == 1 and ids(r["layers_ready"]) == [1]
    finally:
        svc.close()


def _told_slots(r: dict) -> list[int]:
    return [s for n, s in zip(ids(r["layers_ready"]), ids(r["slots"])) if n > 0]


def test_a_landed_block_is_pinned_even_when_a_sibling_of_its_acquire_was_freed(tenants):
    """The acquire fails at its next poll, but until then the slot it was told is its own."""
    svc = tenants
    mgr = svc.node.mgr
    y, z = _sealed(svc, "B", 2, 0xBB), _sealed(svc, "B", 3, 0xBC)
    _to_dram(svc, y, z)
    call(svc, "alloc", "A", n=3, seq=5, pin=True)  # one HBM slot: y is promoted, z waits
    ticket = call(svc, "acquire", "B", blocks=[y, z], timeout_s=30, wait=False)["ticket"]
    mgr.mover.drain()
    told = _told_slots(call(svc, "acquire_poll", "B", ticket=ticket))
    assert told
    call(svc, "free", "B", blocks=[z])
    call(svc, "clear", "x")  # z is dropped: its id is freed
    _tick(svc)  # y lands
    with pytest.raises(P.ProtocolError):  # no room: the told slot is not up for grabs
        call(svc, "alloc", "A", n=1, seq=5, pin=True)
    for slot in told:
        assert int(mgr.table.slot_owner[HBM][slot]) == y and bool((mgr.hbm.host_view(slot) == 0xBB).all())
    with pytest.raises(P.ProtocolError) as e:
        call(svc, "acquire_poll", "B", ticket=ticket)
    assert "freed while the acquire waited" in str(e.value)
    assert int(mgr.table.pins[y]) == 0 and call(svc, "check", "x")["ok"]  # the failure unpinned y


def test_a_listener_error_while_completions_apply_still_pins_what_landed(tenants):
    svc = tenants
    mgr = svc.node.mgr
    y = _sealed(svc, "B", 2, 0xBB)
    _to_dram(svc, y)
    call(svc, "alloc", "A", n=3, seq=5, pin=True)
    ticket = call(svc, "acquire", "B", blocks=[y], timeout_s=30, wait=False)["ticket"]
    mgr.mover.drain()
    told = _told_slots(call(svc, "acquire_poll", "B", ticket=ticket))

    def faulty_listener(kind: str, b: int, tier: int) -> None:  # a bug in a listener (injected)
        if kind == "stored" and b == y:
            raise RuntimeError("listener bug")
    mgr.listeners.append(faulty_listener)
    with pytest.raises(RuntimeError):
        svc.background()  # the server logs it and goes on with the next request
    mgr.listeners.remove(faulty_listener)
    with pytest.raises(P.ProtocolError):
        call(svc, "alloc", "A", n=1, seq=5, pin=True)
    for slot in told:
        assert int(mgr.table.slot_owner[HBM][slot]) == y
    assert call(svc, "acquire_poll", "B", ticket=ticket)["done"]


def test_a_hint_of_an_unreadable_block_does_not_hold_up_the_hints_behind_it(faulty):
    svc = faulty
    mgr = svc.node.mgr
    k = _unreadable(svc, 7)
    assert mgr.counters["keys_detached"] == 1
    m = _sealed(svc, "A", 8, 0xBB, seq=2)
    mgr.demote([m], HBM, DRAM)
    mgr.wait()
    call(svc, "hint", "A", blocks=[k], deadline_s=60.0)  # first in the queue, never readable
    call(svc, "hint", "A", blocks=[m], deadline_s=120.0)
    for _ in range(20):
        _tick(svc)
        mgr.wait()
        if mgr.table.has_copy(m, HBM):
            break
    assert mgr.table.has_copy(m, HBM) and len(svc.node.prefetcher) == 0


def test_a_clear_does_not_drop_a_block_whose_slot_a_poll_reported(tmp_path):
    """A cached block an engine acquires by key lands while a clear drains the transfers in
    flight, after a poll already told the engine its slot: the clear pins it for the ticket
    before it drops anything, so the slot is never handed to another tenant's alloc."""
    svc = _service(tmp_path, 4, 8, 0)
    try:
        for engine, ns in (("A", "tenant-a"), ("B", "tenant-b")):
            call(svc, "register", engine, pid=0, block_bytes=BB, namespace=ns, layout={"layers": 4})
        mgr = svc.node.mgr
        r = call(svc, "alloc", "B", n=1, seq=1, pin=True)
        y, slot = ids(r["blocks"])[0], ids(r["slots"])[0]
        mgr.hbm.host_view(slot)[:] = 0xBB
        key = P.id_bytes(np.array([2], dtype=np.uint64), np.uint64)
        y = ids(call(svc, "seal", "B", blocks=[y], keys=key)["blocks"])[0]
        call(svc, "release", "B", blocks=[y])
        call(svc, "free", "B", blocks=[y])  # cached: sealed, no reference
        mgr.demote([y], HBM, DRAM)
        mgr.wait()
        _tick(svc)
        r = call(svc, "acquire", "B", keys=key, timeout_s=30, wait=False)
        assert not r["done"]
        mgr.mover.drain()  # copied on the mover thread, not applied yet
        r = call(svc, "acquire_poll", "B", ticket=r["ticket"])
        ((layers, reported),) = zip(ids(r["layers_ready"]), ids(r["slots"]))
        assert layers == 4 and reported >= 0  # B may read every layer from that slot now
        assert call(svc, "clear", "A")["dropped"] == 0  # y is the acquire's, not the cache's
        free = int(mgr.table.free_slot_count(HBM))
        for s in ids(call(svc, "alloc", "A", n=free, seq=9, pin=True)["slots"]):
            assert s != reported
            mgr.hbm.host_view(s)[:] = 0xAA
        assert bool((mgr.hbm.host_view(reported) == 0xBB).all())
        r = call(svc, "acquire_poll", "B", ticket=r["ticket"]) if not r["done"] else r
        assert r["done"] and ids(r["blocks"]) == [y]
    finally:
        svc.close()
