"""Namespaces: blocks, keys and bytes never cross between engines of different models or tenants."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.daemon.config import load_config
from kvtier.daemon.namespaces import scoped_keys
from kvtier.daemon.service import Service
from kvtier.protocol import wire as P

from .service_calls import call, ids

BB = 4096


@pytest.fixture
def svc(tmp_path):
    cfg = load_config(environ={}, overrides=[
        f"tiers.hbm_bytes={4 * BB}", "tiers.dram_bytes=0", "tiers.nvme_bytes=0", 'policy.name="lru"',
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"])
    s = Service(cfg)
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


def test_a_namespace_has_the_geometry_of_its_widest_engine():
    """The remote tier's tag binds it; vLLM's scheduler registers a smaller size than the
    workers of its namespace (it only refs), in either order."""
    from kvtier.daemon.namespaces import Namespaces

    for order in ([(BB // 2, 16), (BB, 16)], [(BB, 16), (BB // 2, 16)]):
        n = Namespaces()
        ids_ = {n.id("m", g) for g in order}
        assert ids_ == {1} and n.geometry(1) == (BB, 16) and n.name(1) == "m"
    assert n.geometry(n.id("other")) is None and n.geometry(0) is None


def test_engines_of_two_sizes_register_into_one_namespace(svc):
    """As vLLM's scheduler (a smaller size: it only refs) and its rank's worker do, in either order."""
    for first, second, ns in ((BB, BB // 2, "rank0"), (BB // 2, BB, "rank1")):
        call(svc, "register", f"{ns}-a", pid=0, block_bytes=first, block_tokens=16, namespace=ns)
        call(svc, "register", f"{ns}-b", pid=0, block_bytes=second, block_tokens=16, namespace=ns)
        assert svc.namespaces.geometry(svc.namespaces.id(ns)) == (BB, 16)
