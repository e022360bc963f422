"""Namespaces: blocks, keys and bytes never cross between engines of different models or tenants."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.daemon.namespaces import scoped_keys
from kvtier.protocol import wire as P

from .service_calls import call, hbm_only_service, ids

BB = 4096


@pytest.fixture
def svc(tmp_path):
    s = hbm_only_service(tmp_path, 4, 'policy.name="lru"', block_bytes=BB)
    yield s
    s.close()


def _sealed(svc, engine, key, fill):
    r = call(svc, "alloc", engine, n=1, seq=key, pin=True)
    b, slot = ids(r["blocks"])[0], ids(r["slots"])[0]
    svc.node.mgr.hbm.tensor[slot, :BB] = fill
    c = ids(call(svc, "seal", engine, blocks=[b], keys=P.id_bytes(np.array([key], np.uint64), np.uint64),
                 seq=key)["blocks"])[0]
    call(svc, "release", engine, blocks=[c])
    return c


def _keys(*k):
    return P.id_bytes(np.array(k, dtype=np.uint64), np.uint64)


def test_equal_keys_in_two_namespaces_are_two_blocks(svc):
    call(svc, "register", "a", pid=0, block_bytes=BB, namespace="model-a")
    call(svc, "register", "b", pid=0, block_bytes=BB, namespace="model-b")
    a = _sealed(svc, "a", 7, 11)
    assert ids(call(svc, "ref", "b", keys=_keys(7))["blocks"]) == [-1]  # no membership oracle across
    b = _sealed(svc, "b", 7, 22)  # its own block: no fold into a's
    assert b != a
    assert ids(call(svc, "ref", "a", keys=_keys(7))["blocks"]) == [a]
    assert ids(call(svc, "ref", "b", keys=_keys(7))["blocks"]) == [b]
    m = svc.node.mgr
    assert m.read(a) == bytes([11]) * BB and m.read(b) == bytes([22]) * BB
    assert call(svc, "check", "a")["ok"]


def test_a_block_of_another_namespace_cannot_be_named(svc):
    call(svc, "register", "a", pid=0, block_bytes=BB, namespace="model-a")
    call(svc, "register", "b", pid=0, block_bytes=BB, namespace="model-b")
    a = _sealed(svc, "a", 9, 1)
    for op, extra in (("acquire", {"timeout_s": 1.0}), ("hint", {"deadline_s": 0.1})):
        with pytest.raises(P.ProtocolError) as e:
            call(svc, op, "b", blocks=[a], **extra)
        assert e.value.code == P.INVALID and "unknown block" in e.value.message
        with pytest.raises(P.ProtocolError):
            call(svc, op, "b", keys=_keys(9), **extra)
    r = call(svc, "acquire", "a", blocks=[a], timeout_s=1.0)  # its own engine still can
    assert r["done"]


def test_a_slot_is_zeroed_before_another_namespace_gets_it(svc):
    call(svc, "register", "a", pid=0, block_bytes=BB, namespace="tenant-a")
    call(svc, "register", "b", pid=0, block_bytes=BB, namespace="tenant-b")
    r = call(svc, "alloc", "a", n=4, seq=1, pin=True)
    slots = ids(r["slots"])
    hbm = svc.node.mgr.hbm.tensor
    for s in slots:
        hbm[s, :] = 0x5A  # a secret, in every slot
    call(svc, "release", "a", blocks=ids(r["blocks"]))
    call(svc, "free", "a", seqs=[1])
    zeroed = svc.counters.get("slots_zeroed", 0)
    got = ids(call(svc, "alloc", "b", n=4, seq=1, pin=True)["slots"])
    assert sorted(got) == sorted(slots)
    assert all(int(hbm[s].max()) == 0 for s in got), "another namespace's bytes were left in a slot"
    assert svc.node.mgr.counters["slots_zeroed"] >= 4 + zeroed


def test_the_default_namespace_keeps_keys_as_engines_send_them():
    keys = np.array([0, 7, 2 ** 63, 2 ** 64 - 1], dtype=np.uint64)
    assert np.array_equal(scoped_keys(keys, 0), keys)  # one model per node: events carry the engine's keys
    other = scoped_keys(keys, 1)
    assert len(set(other.tolist())) == 4 and not set(other.tolist()) & set(keys.tolist())


def test_a_clear_that_keeps_live_blocks_sends_removals_not_all_blocks_cleared(svc):
    call(svc, "register", "a", pid=0, block_bytes=BB, namespace="model-a")
    _sealed(svc, "a", 1, 1)  # cached: alloc's reference goes below
    live = _sealed(svc, "a", 2, 2)
    svc.node.events.take_batch()
    cached = ids(call(svc, "lookup", "a", keys=_keys(1))["blocks"])[0]
    call(svc, "free", "a", blocks=[cached])
    call(svc, "clear")
    evs = svc.node.events.take_batch()[1]
    assert {"type": "AllBlocksCleared"} not in evs
    assert [e["type"] for e in evs] == ["BlockRemoved"]
    call(svc, "free", "a", blocks=[live])
    call(svc, "clear")
    assert svc.node.events.take_batch()[1][-1] == {"type": "AllBlocksCleared"}


def test_a_second_model_with_smaller_blocks_registers_and_seals_its_own_size(svc):
    a = call(svc, "register", "a", pid=0, block_bytes=BB, namespace="model-a", layout={"layers": 4})
    assert a["layers"] == 4 and a["block_bytes"] == BB
    b = call(svc, "register", "b", pid=0, block_bytes=BB // 2, namespace="model-b", layout={"layers": 2})
    assert b["block_bytes"] == BB // 2 and b["slot_bytes"] == BB and b["layers"] == 1  # not the first's parts
    r = call(svc, "alloc", "b", n=1, pin=True)
    blk = ids(r["blocks"])[0]
    for too_long in (BB // 2 + 1, BB):  # the slot is wider, the engine's blocks are not
        with pytest.raises(P.ProtocolError, match="exceeds the block size") as e:
            call(svc, "seal", "b", blocks=[blk], keys=_keys(9), nbytes=too_long)
        assert e.value.code == P.INVALID and svc.node.mgr.table.state[blk] == 1  # still open
    c = ids(call(svc, "seal", "b", blocks=[blk], keys=_keys(9))["blocks"])[0]
    assert svc.node.mgr.table.nbytes[c] == BB // 2
    with pytest.raises(P.ProtocolError) as e:
        call(svc, "register", "c", pid=0, block_bytes=2 * BB, namespace="model-c")
    assert e.value.code == P.CONFLICT and "largest model first" in e.value.message
    assert "c" not in svc.engines  # a refused register leaves nothing behind
    # a second tensor-parallel rank of model-a: same geometry, its own namespace, layer-wise parts kept
    r1 = call(svc, "register", "a-tp1", pid=0, block_bytes=BB, namespace="model-a:tp1", layout={"layers": 4})
    assert r1["layers"] == 4


def test_one_name_with_two_geometries_is_two_namespaces():
    """The remote tier's tag and the local key scope bind the geometry: one id per (name, geometry)."""
    from kvtier.daemon.namespaces import Namespaces

    n = Namespaces()
    small, big = n.id("m", (BB // 2, 16)), n.id("m", (BB, 16))
    assert small != big and n.id("m", (BB, 16)) == big and n.id("m", (BB, 32)) not in (small, big)
    assert n.geometry(big) == (BB, 16, "") and n.name(big) == n.name(small) == "m"
    assert n.others("m", (BB, 16)) == [(BB // 2, 16, ""), (BB, 32, "")]
    fp16, bf16 = n.id("m", (BB, 16, "float16")), n.id("m", (BB, 16, "bfloat16"))  # equal sizes, other bytes
    assert len({fp16, bf16, big}) == 3 and n.id("m", (BB, 16, "float16")) == fp16
    assert n.id("", (BB, 16)) == 0 and n.id("", (BB // 2, 16)) > 0  # the default name's first keeps raw keys
    assert n.geometry(n.id("other")) is None


def test_engines_of_two_sizes_in_one_namespace_never_share_blocks(svc, caplog):
    """A 4 KiB engine's ref hit a 2 KiB engine's block of the same key (its slot's tail stale),
    and its seal folded into that block; now they are blocks of two namespaces. Keys are
    scoped by the name, so the second size's block of a shared key stays out of the key index
    (never shared), and its seal leaves its own pins alone (they were dropped: its slot could
    go to another tenant while the engine still wrote it)."""
    call(svc, "register", "big", pid=0, block_bytes=BB, namespace="m")
    with caplog.at_level("WARNING", logger="kvtier.service"):
        call(svc, "register", "small", pid=0, block_bytes=BB // 2, namespace="m")
    assert "shared only between engines of one geometry" in caplog.text
    r = call(svc, "alloc", "small", n=1, pin=True)
    s_blk, slot = ids(r["blocks"])[0], ids(r["slots"])[0]
    svc.node.mgr.hbm.tensor[slot, : BB // 2] = 3
    s_blk = ids(call(svc, "seal", "small", blocks=[s_blk], keys=_keys(77))["blocks"])[0]
    call(svc, "release", "small", blocks=[s_blk])
    assert ids(call(svc, "ref", "big", keys=_keys(77))["blocks"]) == [-1]  # not its size: a miss
    r = call(svc, "alloc", "big", n=1, pin=True)
    b_blk, slot = ids(r["blocks"])[0], ids(r["slots"])[0]
    svc.node.mgr.hbm.tensor[slot, :BB] = 9
    got = ids(call(svc, "seal", "big", blocks=[b_blk], keys=_keys(77))["blocks"])[0]
    t = svc.node.mgr.table
    assert got == b_blk != s_blk and t.pins[b_blk] == 1  # its own block, still pinned by it
    call(svc, "release", "big", blocks=[b_blk])  # the pin it holds: released without error
    assert (t.nbytes[s_blk], t.nbytes[b_blk]) == (BB // 2, BB)
    assert ids(call(svc, "ref", "small", keys=_keys(77))["blocks"]) == [s_blk]
    assert ids(call(svc, "ref", "big", keys=_keys(77))["blocks"]) == [-1]  # kept out of the index
    assert svc.node.mgr.read(b_blk) == bytes([9]) * BB and svc.node.mgr.read(s_blk) == bytes([3]) * (BB // 2)
    assert call(svc, "check", "big") == {"ok": True}


def test_engines_of_two_kv_dtypes_of_one_size_never_share_blocks(svc):
    """An fp16 and a bf16 cache of one model have blocks of one size: keyed by tokens alone,
    the bf16 engine's ``ref`` got the fp16 engine's block and read its bytes as bf16. The dtype
    the layout states is part of the geometry."""
    call(svc, "register", "fp16", pid=0, block_bytes=BB, namespace="m", layout={"dtype": "float16"})
    call(svc, "register", "bf16", pid=0, block_bytes=BB, namespace="m", layout={"dtype": "bfloat16"})
    r = call(svc, "alloc", "fp16", n=1, pin=True)
    blk, slot = ids(r["blocks"])[0], ids(r["slots"])[0]
    svc.node.mgr.hbm.tensor[slot, :BB] = 5
    blk = ids(call(svc, "seal", "fp16", blocks=[blk], keys=_keys(31))["blocks"])[0]
    call(svc, "release", "fp16", blocks=[blk])
    assert ids(call(svc, "ref", "bf16", keys=_keys(31))["blocks"]) == [-1]  # another dtype: a miss
    assert ids(call(svc, "ref", "fp16", keys=_keys(31))["blocks"]) == [blk]
    call(svc, "register", "fp16-b", pid=0, block_bytes=BB, namespace="m", layout={"dtype": "float16"})
    assert ids(call(svc, "ref", "fp16-b", keys=_keys(31))["blocks"]) == [blk]  # one dtype: shared


def test_a_refs_only_engine_sees_every_geometry_of_its_name_and_touches_no_bytes(svc):
    """vLLM's scheduler computes its worker's block size from its own KV-cache config; where
    that differs (cross-layer KV sharing) it still finds and hints the worker's blocks."""
    call(svc, "register", "worker", pid=0, block_bytes=BB, namespace="m")
    call(svc, "register", "sched", pid=0, block_bytes=BB - 64, namespace="m", refs_only=True)
    call(svc, "register", "other", pid=0, block_bytes=BB, namespace="n")
    blk = _sealed(svc, "worker", 5, 7)
    _sealed(svc, "other", 6, 8)
    found = call(svc, "lookup", "sched", keys=_keys(5, 6))
    assert ids(found["blocks"]) == [blk, -1]  # another name's block: never
    call(svc, "hint", "sched", blocks=[blk])
    for op, args in (("alloc", {"n": 1}), ("acquire", {"blocks": [blk]}),
                     ("seal", {"blocks": [blk], "keys": _keys(9)})):
        with pytest.raises(P.ProtocolError, match="refs_only") as e:
            call(svc, op, "sched", **args)
        assert e.value.code == P.INVALID
    assert call(svc, "check", "worker") == {"ok": True}


def test_telemetry_touches_only_the_reporting_engine_s_blocks(svc):
    """Attention reports named any block id: an engine could raise or lower another
    namespace's blocks' importance (and so their placement). Unregistered senders are refused."""
    call(svc, "register", "a", pid=0, block_bytes=BB, namespace="model-a")
    call(svc, "register", "b", pid=0, block_bytes=BB, namespace="model-b")
    a_blk, b_blk = _sealed(svc, "a", 1, 1), _sealed(svc, "b", 2, 2)
    imp = svc.node.mgr.table.importance
    before = imp[[a_blk, b_blk]].copy()
    msg = {"v": P.VERSION, "kind": "attention", "blocks": P.id_bytes(np.array([a_blk, b_blk])),
           "mass": np.array([50.0, 50.0], "<f4").tobytes()}
    assert svc.ingest({**msg, "engine": "a"}) == 1  # its own block only
    assert imp[b_blk] == before[1] and imp[a_blk] != before[0]
    rejected = svc.counters["telemetry_rejected"]
    assert svc.ingest({**msg, "engine": "nobody"}) == 0 and svc.counters["telemetry_rejected"] == rejected + 1
