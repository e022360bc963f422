"""Two in-process services share a real cluster: random ops, every invariant after every step,
and every block node B gets from the cluster holds exactly the bytes node A sealed under its key."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

pytest.importorskip("redis")

from kvtier.daemon.config import load_config  # noqa: E402
from kvtier.daemon.remote_ops import RefWaiter  # noqa: E402
from kvtier.daemon.service import Service  # noqa: E402
from kvtier.protocol import wire as P  # noqa: E402
from kvtier.tiers.remote_store import namespace_tag, value_name  # noqa: E402

from .service_calls import call, ids  # noqa: E402

BB = 4096
STEPS = 300


def _service(tmp_path, name, cluster, fleet, bb=BB):
    cfg = load_config(environ={}, overrides=[
        'tiers.remote.password="kvtier-test-pw"',
        f"tiers.hbm_bytes={bb * 12}", f"tiers.dram_bytes={bb * 12}", f"tiers.nvme_bytes={bb * 24}",
        f'tiers.nvme_dir="{tmp_path}/{name}/nvme"', f'server.runtime_dir="{tmp_path}/{name}/run"', "metrics.enabled=false",
        "tiers.remote.enabled=true", f"tiers.remote.nodes={json.dumps(cluster.nodes)}",
        f'tiers.remote.namespace="{fleet}"', "tiers.remote.batch_blocks=4", "tiers.remote.lookup_timeout_s=5.0"])
    return Service(cfg)


def _pattern(key: int) -> np.ndarray:
    return np.random.default_rng(key).integers(0, 256, BB, dtype=np.uint8)


def _settle(svc: Service, until=None, timeout: float = 10.0) -> dict:
    """Run the owner loop's idle work until ``until`` (a waiter) is answered; returns answers by waiter id."""
    answers: dict[int, object] = {}
    end = time.monotonic() + timeout
    while True:
        svc.background()
        for w, res in svc.advance():
            answers[id(w)] = res
        svc.maintain()
        if (until is None and not svc.busy()) or (until is not None and id(until) in answers) or time.monotonic() > end:
            return answers
        time.sleep(0.001)


def _ref(svc: Service, engine: str, keys: list[int]) -> np.ndarray:
    r = call(svc, "ref", engine, keys=keys)
    if isinstance(r, RefWaiter):
        r = _settle(svc, r)[id(r)]
    assert isinstance(r, dict), r
    return np.asarray(ids(r["blocks"]))


def test_random_ops_on_two_nodes_keep_invariants_and_bytes(tmp_path, redis_cluster):
    rng = np.random.default_rng(7)
    a, b = _service(tmp_path, "a", redis_cluster, "rand"), _service(tmp_path, "b", redis_cluster, "rand")
    try:
        for svc, e in ((a, "a1"), (a, "a2"), (b, "b1")):
            call(svc, "register", e, pid=0, block_bytes=BB)
        held: dict[str, list[int]] = {"a1": [], "a2": [], "b1": []}
        sealed_keys: set[int] = set()
        served = 0
        for _ in range(STEPS):
            e = ["a1", "a2"][int(rng.integers(2))]
            op = rng.choice(["write", "ref", "free", "acquire", "b_ref", "b_free"])
            if op == "write":  # alloc, fill with the key's pattern, seal (keys from a small pool: shared)
                k = int(rng.integers(1, 40))
                r = call(a, "alloc", e, n=1, seq=1, pin=False)
                blk, slot = ids(r["blocks"])[0], ids(r["slots"])[0]
                a.node.mgr.hbm.host_view(slot)[:] = _pattern(k)
                c = ids(call(a, "seal", e, blocks=[blk], keys=[k])["blocks"])[0]
                held[e].append(c)
                sealed_keys.add(k)
            elif op == "ref" and sealed_keys:
                got = _ref(a, e, [int(rng.choice(sorted(sealed_keys)))])
                held[e] += [int(x) for x in got if x >= 0]
            elif op == "free" and held[e]:
                x = held[e].pop(int(rng.integers(len(held[e]))))
                call(a, "free", e, blocks=[x])
            elif op == "acquire" and held[e]:
                x = int(rng.choice(held[e]))
                r = call(a, "acquire", e, blocks=[x], wait=False, timeout_s=5.0)
                while not r.get("done"):  # promoted from DRAM or NVMe: poll the ticket until pinned
                    _settle(a, timeout=0.01)
                    r = call(a, "acquire_poll", e, ticket=r["ticket"])
                call(a, "release", e, blocks=[x])
            elif op == "b_ref":
                k = int(rng.integers(1, 40))
                got = _ref(b, "b1", [k])
                if got[0] >= 0:  # found (locally, or in the cluster): exactly A's bytes for that key
                    assert b.node.mgr.read(int(got[0])) == _pattern(k).tobytes()
                    held["b1"].append(int(got[0]))
                    served += 1
            elif op == "b_free" and held["b1"]:
                call(b, "free", "b1", blocks=[held["b1"].pop()])
            for svc in (a, b):
                _settle(svc, timeout=0.05)
                assert call(svc, "check", "a1" if svc is a else "b1") == {"ok": True}
        sa, sb = a.stats()["remote"], b.stats()["remote"]
        assert sa["published"] > 0 and sb["hits"] > 0 and served >= sb["hits"]
        assert sa["errors"] == {"put": 0, "get": 0} and sb["corrupt"] == 0
        # every block A published is shared (reused at least once on A); B publishes nothing it only read
        assert sb["published"] == 0
    finally:
        a.close()
        b.close()


def test_a_ref_of_a_reclaimed_engine_is_answered_and_leaves_nothing(tmp_path, redis_cluster):
    b = _service(tmp_path, "b", redis_cluster, "reclaim")
    try:
        call(b, "register", "b1", pid=0, block_bytes=BB)
        w = call(b, "ref", "b1", keys=[123456])
        assert isinstance(w, RefWaiter)
        b.reclaim("b1", "unregistered")
        answers = _settle(b, w)
        assert getattr(answers[id(w)], "code", None) == P.UNKNOWN_ENGINE
        call(b, "register", "b2", pid=0, block_bytes=BB)
        assert call(b, "check", "b2") == {"ok": True} and b.node.remote.fetching == {}
    finally:
        b.close()


def test_a_publish_that_failed_is_retried_when_the_cluster_is_back(tmp_path, redis_cluster):
    a = _service(tmp_path, "a", redis_cluster, "retry")
    try:
        for e in ("a1", "a2"):
            call(a, "register", e, pid=0, block_bytes=BB)
        a.node.remote.tier.backoff.base_s = a.node.remote.tier.backoff.max_s = 0.1
        shard = redis_cluster.shard_of(value_name(namespace_tag("retry", "", (BB, 16)), 5))
        redis_cluster.kill(shard)  # the shard that holds key 5
        try:
            r = call(a, "alloc", "a1", n=1, seq=1, pin=False)
            a.node.mgr.hbm.host_view(ids(r["slots"])[0])[:] = _pattern(5)
            call(a, "seal", "a1", blocks=ids(r["blocks"]), keys=[5])
            assert _ref(a, "a2", [5])[0] >= 0  # shared: a candidate; the put fails while a shard is down
            end = time.monotonic() + 10
            while a.stats()["remote"]["errors"]["put"] == 0 and time.monotonic() < end:
                _settle(a, timeout=0.05)
            st = a.stats()["remote"]
            assert st["errors"]["put"] >= 1 and st["published"] == 0 and st["state"] == "degraded"
        finally:
            redis_cluster.restart(shard)
        end = time.monotonic() + 20
        while a.stats()["remote"]["published"] == 0 and time.monotonic() < end:
            _settle(a, timeout=0.05)
        assert a.stats()["remote"]["published"] == 1 and a.stats()["remote"]["state"] == "ok"
        assert call(a, "check", "a1") == {"ok": True}
    finally:
        a.close()


def test_an_unreachable_cluster_at_start_is_a_degraded_tier_not_a_dead_node(tmp_path):
    from kvtier.bench.redis_cluster import free_port

    cfg = load_config(environ={}, overrides=[
        f"tiers.hbm_bytes={BB * 8}", f"tiers.dram_bytes={BB * 8}", "tiers.nvme_bytes=0",
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false", "tiers.remote.enabled=true",
        f'tiers.remote.nodes=["127.0.0.1:{free_port()}"]', "tiers.remote.connect_timeout_s=0.2"])
    svc = Service(cfg)  # nobody listens there: starts anyway
    try:
        call(svc, "register", "e", pid=0, block_bytes=BB)
        r = call(svc, "alloc", "e", n=1, seq=1, pin=False)
        call(svc, "seal", "e", blocks=ids(r["blocks"]), keys=[77])
        assert _ref(svc, "e", [77, 78]).tolist() == [ids(r["blocks"])[0], -1]  # local hit; the miss at once
        st = svc.stats()["remote"]
        assert st["state"] == "degraded" and "cannot reach" in st["last_error"] and st["lookups_skipped_degraded"] == 1
    finally:
        svc.close()


def test_nodes_of_one_namespace_with_another_block_size_never_share_values(tmp_path, redis_cluster):
    """A node whose engines write half-size blocks (another KV dtype) under the same namespace
    name: its values are not the other node's hits (they were served as hits, the slot's tail
    stale bytes), and the other node's lookups do not delete them as corrupt."""
    half = BB // 2
    small, big, peer = (_service(tmp_path, n, redis_cluster, "geo", bb=bb)
                        for n, bb in (("s", half), ("b", BB), ("p", half)))
    try:
        for svc, e, bb in ((small, "s1", half), (small, "s2", half), (big, "b1", BB), (peer, "p1", half)):
            call(svc, "register", e, pid=0, block_bytes=bb)
        data = _pattern(1001)[:half]
        r = call(small, "alloc", "s1", n=1, seq=1, pin=False)
        small.node.mgr.hbm.host_view(ids(r["slots"])[0])[:half] = data
        call(small, "seal", "s1", blocks=ids(r["blocks"]), keys=[1001])
        assert _ref(small, "s2", [1001])[0] >= 0  # shared on its node: published
        end = time.monotonic() + 10
        while small.stats()["remote"]["published"] == 0 and time.monotonic() < end:
            _settle(small, timeout=0.05)
        assert small.stats()["remote"]["published"] == 1
        assert _ref(big, "b1", [1001]).tolist() == [-1]  # another geometry: not its key
        assert big.stats()["remote"]["corrupt"] == 0
        got = _ref(peer, "p1", [1001])  # the same geometry on a third node: a verified hit
        assert got[0] >= 0 and peer.node.mgr.read(int(got[0]))[:half] == data.tobytes()
    finally:
        for svc in (small, big, peer):
            svc.close()


def test_narrower_engines_of_a_namespace_publish_under_their_own_tag(tmp_path, redis_cluster):
    """Engines of one namespace name with another block size are a namespace of their own:
    their blocks are published under their geometry's tag, never under the wide engines' (a
    peer would otherwise take 2 KiB of bytes for a 4 KiB block, the slot's tail stale), and a
    value of another length found under a tag is a miss."""
    from kvtier.tiers.remote_store import RedisClusterStore

    from ..tiers.test_remote import _put

    half = BB // 2
    a, b = _service(tmp_path, "a", redis_cluster, "narrow"), _service(tmp_path, "b", redis_cluster, "narrow")
    try:
        for e, bb in (("w", BB), ("n1", half), ("n2", half)):
            call(a, "register", e, pid=0, block_bytes=bb)
        r = call(a, "alloc", "n1", n=1, seq=1, pin=False)
        a.node.mgr.hbm.host_view(ids(r["slots"])[0])[:half] = _pattern(501)[:half]
        call(a, "seal", "n1", blocks=ids(r["blocks"]), keys=[501])
        assert _ref(a, "n2", [501])[0] >= 0  # shared by two narrow engines: a candidate
        end = time.monotonic() + 10
        while a.stats()["remote"]["published"] == 0 and time.monotonic() < end:
            _settle(a, timeout=0.02)
        assert a.stats()["remote"]["published"] == 1
        store = RedisClusterStore(redis_cluster.nodes, password="kvtier-test-pw")
        narrow, wide = namespace_tag("narrow", "", (half, 16)), namespace_tag("narrow", "", (BB, 16))
        assert store.client.exists(value_name(narrow, 501)) == 1 and store.client.exists(value_name(wide, 501)) == 0
        assert _put(store, wide, [502], [_pattern(502)[:half]]).all()  # a short value under the wide tag
        store.close()
        call(b, "register", "b1", pid=0, block_bytes=BB)
        assert _ref(b, "b1", [501, 502]).tolist() == [-1, -1]  # not its geometry; another length: misses
        rb = b.stats()["remote"]
        assert rb["hits"] == 0 and rb["corrupt"] == 0
        call(b, "register", "b2", pid=0, block_bytes=half)  # the narrow geometry on node B: a verified hit
        got = _ref(b, "b2", [501])
        assert got[0] >= 0 and b.node.mgr.read(int(got[0])) == _pattern(501)[:half].tobytes()
        assert call(b, "check", "b1") == {"ok": True}
    finally:
        a.close()
        b.close()


def test_a_publish_stuck_on_a_hung_shard_does_not_hold_up_an_acquire(tmp_path, redis_cluster):
    """A put reads its blocks' bytes for up to a few ``timeout_s`` on a hung shard. That read
    hold keeps every copy where it is, but an engine's acquire of the block pins it at once
    (it waited for the put before: seconds, past a 0.5 s acquire deadline)."""
    import os
    import signal

    a = _service(tmp_path, "a", redis_cluster, "stuck")
    try:
        for e in ("a1", "a2"):
            call(a, "register", e, pid=0, block_bytes=BB)
        tag = namespace_tag("stuck", "", (BB, 16))
        key = next(k for k in range(1, 1000) if redis_cluster.shard_of(value_name(tag, k)) == 2)
        r = call(a, "alloc", "a1", n=1, seq=1, pin=False)
        blk = ids(r["blocks"])[0]
        a.node.mgr.hbm.host_view(ids(r["slots"])[0])[:] = _pattern(key)
        call(a, "seal", "a1", blocks=[blk], keys=[key])
        t = a.node.mgr.table
        proc = redis_cluster.procs[2]
        assert proc is not None
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            assert _ref(a, "a2", [key])[0] == blk  # shared: published, into the hung shard
            end = time.monotonic() + 5
            while t.readers[blk] == 0 and time.monotonic() < end:
                _settle(a, timeout=0.01)
            assert t.readers[blk] == 1 and a.node.remote.busy()  # the put is in flight, stuck
            t0 = time.monotonic()
            got = call(a, "acquire", "a2", blocks=[blk], wait=False, timeout_s=0.5)
            assert got["done"] and time.monotonic() - t0 < 0.25
            slot = ids(got["slots"])[0]
            assert a.node.mgr.hbm.host_view(slot).tobytes() == _pattern(key).tobytes()
            call(a, "release", "a2", blocks=[blk])
            assert call(a, "check", "a1") == {"ok": True}
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        end = time.monotonic() + 15
        while t.readers[blk] and time.monotonic() < end:
            _settle(a, timeout=0.05)
        assert t.readers[blk] == 0 and t.busy[blk] == 0
        assert call(a, "check", "a1") == {"ok": True}
    finally:
        a.close()


def test_a_missed_fetchs_placeholder_leaves_nothing_to_the_next_block_of_its_id(tmp_path, redis_cluster):
    """An engine names a remote fetch's placeholder by id (a hint, an attention report); the
    fetch misses and the id is freed. The next block to take the id, another tenant's, starts
    with no hint protection and a neutral score (they had carried over: the placeholder went
    without a "removed" event)."""
    svc = _service(tmp_path, "a", redis_cluster, "leak")
    try:
        call(svc, "register", "x", pid=0, block_bytes=BB, namespace="tenant-x")
        call(svc, "register", "y", pid=0, block_bytes=BB, namespace="tenant-y")
        node = svc.node
        t = node.mgr.table
        w = call(svc, "ref", "x", keys=[0xDEAD_BEEF])  # in no cluster: a placeholder, then a miss
        assert isinstance(w, RefWaiter)
        (ph,) = node.remote.fetching.values()
        call(svc, "hint", "x", blocks=[ph], deadline_s=3600.0)
        assert svc.ingest({"v": P.VERSION, "engine": "x", "kind": "attention", "blocks": P.id_bytes([ph]),
                           "mass": np.array([1.0], np.float32).tobytes()}) == 1
        assert ids(_settle(svc, w)[id(w)]["blocks"]) == [-1]
        assert t.state[ph] == 0  # FREE
        fresh = ids(call(svc, "alloc", "y", n=1, seq=1, pin=False)["blocks"])[0]
        got = fresh
        for _ in range(t.max_blocks + 1):  # round the free list until y's alloc takes the id
            if got == ph:
                break
            call(svc, "free", "y", blocks=[got])
            got = ids(call(svc, "alloc", "y", n=1, seq=1, pin=False)["blocks"])[0]
        assert got == ph
        assert node.placement.protect_until[ph] <= svc.clock()
        assert node.scores.reports[ph] == 0
        other = ids(call(svc, "alloc", "y", n=1, seq=2, pin=False)["blocks"])[0]  # a block no one named
        assert node.scores.score(np.array([ph]))[0] == node.scores.score(np.array([other]))[0]
        svc.blocks.op_check(None, None)
    finally:
        svc.close()
