"""The remote tier's store and worker against a real three-shard Redis Cluster."""

from __future__ import annotations

import time

import numpy as np
import pytest
import xxhash

from kvtier.kernels.checksum import block_checksum
from kvtier.tiers.remote import RemoteTier, connect_store
from kvtier.tiers.remote_store import RedisClusterStore, RemoteAuthError, RemoteError, namespace_tag, value_name

PW = "kvtier-test-pw"


def _blocks(n: int, size: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def _put(store: RedisClusterStore, tag: int, keys: list[int], bufs: list[np.ndarray]) -> np.ndarray:
    lengths = np.array([b.size for b in bufs], dtype=np.int64)
    sums = np.array([block_checksum(b, b.size) for b in bufs], dtype=np.uint64)
    return store.put_many(np.full(len(keys), tag, np.uint64), np.array(keys, np.uint64), bufs, lengths, sums)


def test_round_trip_chunks_and_namespaces(redis_cluster):
    store = RedisClusterStore(redis_cluster.nodes, password=PW, chunk_bytes=4096)
    tag, other = namespace_tag("fleet", "llama"), namespace_tag("fleet", "qwen")
    bufs = _blocks(6, 10_000, 1) + [np.arange(5, dtype=np.uint8)]  # 3 chunks each, and a short one
    keys = [0x1000 + i for i in range(len(bufs))]
    assert _put(store, tag, keys, bufs).all()
    dsts = [np.zeros(10_000, np.uint8) for _ in bufs]
    got = store.get_many(np.full(len(keys), tag, np.uint64), np.array(keys, np.uint64), dsts)
    assert got.found.all() and got.corrupt == 0
    for src, dst, n in zip(bufs, dsts, got.lengths.tolist()):
        assert n == src.size and bytes(dst[:n]) == src.tobytes()
    # another model's namespace never sees these keys
    miss = store.get_many(np.full(len(keys), other, np.uint64), np.array(keys, np.uint64), dsts)
    assert not miss.found.any() and miss.corrupt == 0
    store.close()


def test_corrupt_value_is_refused_counted_and_deleted(redis_cluster):
    store = RedisClusterStore(redis_cluster.nodes, password=PW, chunk_bytes=4096)
    tag = namespace_tag("fleet", "corrupt")
    bufs = _blocks(3, 9000, 2)
    keys = [7, 8, 9]
    assert _put(store, tag, keys, bufs).all()
    name = value_name(tag, 8, 1)
    part = bytearray(store.client.get(name))
    part[17] ^= 0x40  # one bit flipped in the middle chunk
    store.client.set(name, bytes(part))
    dsts = [np.zeros(9000, np.uint8) for _ in keys]
    got = store.get_many(np.full(3, tag, np.uint64), np.array(keys, np.uint64), dsts)
    assert got.found.tolist() == [True, False, True] and got.corrupt == 1
    assert [store.client.exists(value_name(tag, 8, i)) for i in ("h", 0, 1, 2)] == [0, 0, 0, 0]  # deleted, all
    # a header naming another key (a value copied under the wrong name) is refused too
    for i in ("h", 0, 1, 2):
        store.client.set(value_name(tag, 10, i), store.client.get(value_name(tag, 7, i)))
    got = store.get_many(np.array([tag], np.uint64), np.array([10], np.uint64), [np.zeros(9000, np.uint8)])
    assert not got.found[0] and got.corrupt == 1
    # a block the shard's eviction took part of is a miss, not corrupt, and its other chunks go
    store.client.delete(value_name(tag, 9, 2))
    got = store.get_many(np.array([tag], np.uint64), np.array([9], np.uint64), [np.zeros(9000, np.uint8)])
    assert not got.found[0] and got.corrupt == 0 and store.client.exists(value_name(tag, 9)) == 0
    store.close()


def test_wrong_password_is_a_clear_error(redis_cluster):
    with pytest.raises(RemoteAuthError, match="wrong user or password") as e:
        RedisClusterStore(redis_cluster.nodes, password="not-the-password")
    assert "not-the-password" not in str(e.value)
    with pytest.raises(RemoteAuthError, match="needs a password and none was given"):
        RedisClusterStore(redis_cluster.nodes)


def test_worker_completions_and_degraded_when_a_shard_dies(redis_cluster):
    tier = RemoteTier(connect_store(redis_cluster.nodes, password=PW, timeout_s=0.5, connect_timeout_s=0.5),
                      workers=2, backoff_s=0.05, backoff_max_s=0.2)
    try:
        tag = namespace_tag("fleet", "worker")
        bufs = _blocks(16, 4096, 3)
        keys = np.arange(100, 116, dtype=np.uint64)
        sums = np.array([block_checksum(b, b.size) for b in bufs], dtype=np.uint64)
        tid = tier.submit("put", np.arange(16), np.full(16, tag, np.uint64), keys, bufs, np.full(16, 4096), sums)
        assert tid is not None
        (c,) = tier.wait()
        assert c.ok.all() and c.nbytes == 16 * 4096 and not tier.degraded
        redis_cluster.kill(1)
        try:
            dsts = [np.zeros(4096, np.uint8) for _ in range(16)]
            tier.submit("get", np.arange(16), np.full(16, tag, np.uint64), keys, dsts)
            (c,) = tier.wait(30)
            assert c.error and not c.ok.any() and tier.degraded and not tier.available()
        finally:
            redis_cluster.restart(1)
        deadline = time.monotonic() + 30
        while True:  # recovers: the first batch after the backoff that succeeds clears the state
            while not tier.available():
                time.sleep(0.01)
            dsts = [np.zeros(4096, np.uint8) for _ in range(16)]
            tier.submit("get", np.arange(16), np.full(16, tag, np.uint64), keys, dsts)
            (c,) = tier.wait(30)
            if not c.error or time.monotonic() > deadline:
                break
        assert not c.error and not tier.degraded
        # the restarted shard came back empty (no persistence): its keys miss, the others' hit, bytes exact
        assert 0 < c.ok.sum() <= 16
        for i in np.flatnonzero(c.ok).tolist():
            assert np.array_equal(dsts[i], bufs[i])
    finally:
        tier.close()


def test_values_of_another_format_or_chunk_size_are_misses_left_in_place(redis_cluster):
    """A rolling upgrade (another header version) or a config drift (another chunk_bytes)
    must not wipe the cluster: such a value is a miss for this reader and stays for others;
    a larger writer's chunks are read whole, verified by the checksum like any value."""
    import kvtier.tiers.remote_store as rs

    small = RedisClusterStore(redis_cluster.nodes, password=PW, chunk_bytes=4096)
    large = RedisClusterStore(redis_cluster.nodes, password=PW, chunk_bytes=16384)
    tag = namespace_tag("fleet", "formats")
    bufs = _blocks(2, 9000, 4)
    dst = lambda: [np.zeros(9000, np.uint8)]  # noqa: E731
    one = lambda store, k, d: store.get_many(np.array([tag], np.uint64), np.array([k], np.uint64), d)  # noqa: E731
    assert _put(small, tag, [21], bufs[:1]).all() and _put(large, tag, [22], bufs[1:]).all()
    got = one(large, 21, dst())  # 3 chunks of 4 KiB; this reader fetched 1 part
    assert not got.found[0] and got.corrupt == 0
    assert [small.client.exists(value_name(tag, 21, i)) for i in ("h", 0, 1, 2)] == [1, 1, 1, 1]
    assert one(small, 21, dst()).found[0]  # its writer's geometry still reads it
    d = dst()
    got = one(small, 22, d)  # one 16 KiB chunk (of 9000 bytes); this reader fetched 3 parts
    assert got.found[0] and got.corrupt == 0 and bytes(d[0]) == bufs[1].tobytes()
    mine = small.client.get(value_name(tag, 21))
    newer = bytearray(mine)
    newer[4:8] = (rs.VERSION + 1).to_bytes(4, "little")  # a newer writer's format, its check recomputed
    newer[-4:] = xxhash.xxh32_intdigest(bytes(newer[:-4])).to_bytes(4, "little")
    v1 = rs.MAGIC + (1).to_bytes(4, "little") + bytes(40)  # a version-1 writer's 48-byte header
    for header in (bytes(newer), v1):
        small.client.set(value_name(tag, 21), header)
        got = one(small, 21, dst())
        assert not got.found[0] and got.corrupt == 0 and small.client.get(value_name(tag, 21)) == header
    small.close()
    large.close()


@pytest.mark.parametrize("byte", [4, 44, 50])  # the version, the chunk count, the nonce
def test_a_bit_flipped_in_the_header_is_corrupt_not_foreign(redis_cluster, byte):
    """The header checks its own bytes: a flipped version or chunk count read as another
    format's value before (a miss, never cleaned up); now it is corrupt, counted and deleted."""
    store = RedisClusterStore(redis_cluster.nodes, password=PW, chunk_bytes=4096)
    tag = namespace_tag("fleet", "flips")
    assert _put(store, tag, [41], _blocks(1, 9000, 6)).all()
    head = bytearray(store.client.get(value_name(tag, 41)))
    head[byte] ^= 0x01
    store.client.set(value_name(tag, 41), bytes(head))
    got = store.get_many(np.array([tag], np.uint64), np.array([41], np.uint64), [np.zeros(9000, np.uint8)])
    assert not got.found[0] and got.corrupt == 1
    assert [store.client.exists(value_name(tag, 41, i)) for i in ("h", 0, 1, 2)] == [0, 0, 0, 0]
    store.close()


@pytest.mark.parametrize("damage", ["partial", "corrupt"])
def test_a_copy_published_while_a_reader_refused_the_old_one_is_not_deleted(redis_cluster, damage):
    """A reader refuses a torn (or corrupt) value; before its delete runs, another node publishes
    the block again. The delete is conditional on the header it refused (each write's nonce
    differs), so the good copy stays and serves the next read; it was deleted before."""
    store = RedisClusterStore(redis_cluster.nodes, password=PW, chunk_bytes=4096)
    other = RedisClusterStore(redis_cluster.nodes, password=PW, chunk_bytes=4096)
    tag = namespace_tag("fleet", f"race-{damage}")
    buf = _blocks(1, 9000, 7)
    assert _put(store, tag, [51], buf).all()
    if damage == "partial":
        store.client.delete(value_name(tag, 51, 2))  # the shard's eviction took a chunk
    else:
        part = bytearray(store.client.get(value_name(tag, 51, 1)))
        part[3] ^= 0x10
        store.client.set(value_name(tag, 51, 1), bytes(part))
    delete = store._delete

    def republished_first(values):  # the other node's put lands between the read and the delete
        assert _put(other, tag, [51], buf).all()
        delete(values)

    store._delete = republished_first  # type: ignore[method-assign]
    got = store.get_many(np.array([tag], np.uint64), np.array([51], np.uint64), [np.zeros(9000, np.uint8)])
    assert not got.found[0] and got.corrupt == (damage == "corrupt")
    store._delete = delete  # type: ignore[method-assign]
    dst = np.zeros(9000, np.uint8)
    got = store.get_many(np.array([tag], np.uint64), np.array([51], np.uint64), [dst])
    assert got.found[0] and bytes(dst) == buf[0].tobytes()
    store.close()
    other.close()


def test_a_key_holding_another_type_fails_alone_and_is_removed(redis_cluster):
    store = RedisClusterStore(redis_cluster.nodes, password=PW, chunk_bytes=4096)
    tag = namespace_tag("fleet", "types")
    bufs = _blocks(3, 5000, 5)
    assert _put(store, tag, [31, 32, 33], bufs).all()
    store.client.delete(value_name(tag, 32, 0))
    store.client.rpush(value_name(tag, 32, 0), b"x")  # a list where a chunk should be
    dsts = [np.zeros(5000, np.uint8) for _ in range(3)]
    got = store.get_many(np.full(3, tag, np.uint64), np.array([31, 32, 33], np.uint64), dsts)
    assert got.found.tolist() == [True, False, True] and got.corrupt == 1
    assert bytes(dsts[0]) == bufs[0].tobytes() and bytes(dsts[2]) == bufs[2].tobytes()
    assert [store.client.exists(value_name(tag, 32, i)) for i in ("h", 0, 1)] == [0, 0, 0]
    store.close()


def test_writes_the_cluster_refuses_fail_the_job_and_back_off(redis_cluster):
    """A full cluster under noeviction refuses SETs with OOM: the job says so and publishing
    backs off, instead of the block being offered again at once (1,406 batches in 2 s before)."""
    tier = RemoteTier(connect_store(redis_cluster.nodes, password=PW), workers=1, backoff_s=0.05, backoff_max_s=0.2)
    store = RedisClusterStore(redis_cluster.nodes, password=PW)
    primaries = store.client.get_primaries()
    before = [store.client.config_get("maxmemory*", target_nodes=node) for node in primaries]
    try:
        for node in primaries:
            store.client.config_set("maxmemory", "1", target_nodes=node)
            store.client.config_set("maxmemory-policy", "noeviction", target_nodes=node)
        bufs = _blocks(2, 4096, 6)
        sums = np.array([block_checksum(b, b.size) for b in bufs], dtype=np.uint64)
        tier.submit("put", np.arange(2), np.full(2, namespace_tag("fleet", "oom"), np.uint64),
                    np.array([41, 42], np.uint64), bufs, np.full(2, 4096), sums)
        (c,) = tier.wait()
        assert not c.ok.any() and c.refused and "refused" in c.error and "maxmemory" in c.error
        # publishing backs off; reads still serve (a full cluster still holds what it holds)
        assert tier.refusing and not tier.writable() and "maxmemory" in tier.last_refusal
        assert not tier.degraded and tier.available()
        tier.submit("get", np.arange(1), np.full(1, namespace_tag("fleet", "oom"), np.uint64),
                    np.array([41], np.uint64), [np.zeros(4096, np.uint8)])
        (g,) = tier.wait()
        assert not g.error and not g.ok.any() and tier.refusing  # a read does not end the write backoff
    finally:
        for node, was in zip(primaries, before):
            store.client.config_set("maxmemory", was["maxmemory"], target_nodes=node)
            store.client.config_set("maxmemory-policy", was["maxmemory-policy"], target_nodes=node)
        store.close()
        tier.close()


def test_a_hung_shard_fails_a_batch_within_a_few_timeouts(redis_cluster):
    """No retries inside a batch: the tier's backoff is the retry. redis-py's default ten
    retries held a one-block read 23 s against a stopped shard at timeout_s = 1."""
    import os
    import signal

    store = RedisClusterStore(redis_cluster.nodes, password=PW, timeout_s=0.5, connect_timeout_s=0.5)
    tag = namespace_tag("fleet", "hung")
    key = next(k for k in range(1, 1000) if redis_cluster.shard_of(value_name(tag, k)) == 2)
    proc = redis_cluster.procs[2]
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(RemoteError):
            store.get_many(np.array([tag], np.uint64), np.array([key], np.uint64), [np.zeros(4096, np.uint8)])
        assert time.monotonic() - t0 < 6 * 0.5
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        store.close()


def test_a_put_timing_out_on_a_hung_shard_degrades_the_tier_not_refused(redis_cluster):
    """redis-py 8 stores a timed-out command's exception among a pipeline's results: that is
    the transport failing (degraded: lookups stop), not the cluster refusing writes."""
    import os
    import signal

    tier = RemoteTier(connect_store(redis_cluster.nodes, password=PW, timeout_s=0.5, connect_timeout_s=0.5),
                      workers=1, backoff_s=0.05, backoff_max_s=0.2)
    tag = namespace_tag("fleet", "hung-put")
    keys = np.array([k for k in range(1, 1000) if redis_cluster.shard_of(value_name(tag, k)) == 2][:2] + [7], np.uint64)
    bufs = _blocks(3, 4096, 8)
    sums = np.array([block_checksum(b, b.size) for b in bufs], dtype=np.uint64)
    proc = redis_cluster.procs[2]
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        tier.submit("put", np.arange(3), np.full(3, tag, np.uint64), keys, bufs, np.full(3, 4096), sums)
        (c,) = tier.wait(30)
        assert c.error and not c.refused and tier.degraded and not tier.refusing
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        tier.close()


def test_a_late_success_of_an_older_batch_does_not_clear_a_newer_failure(redis_cluster):
    """Two workers: a batch sent first finishes (fine) after a batch sent second failed. The
    tier stays degraded until a batch sent after the failure succeeds (the late success
    cleared it, so lookups resumed against a failing cluster at once)."""
    import threading

    gate = threading.Event()
    real = RedisClusterStore(redis_cluster.nodes, password=PW)
    slow_tag, failing_tag = namespace_tag("fleet", "late-ok"), namespace_tag("fleet", "late-bad")

    class Injected:  # the real store, with one batch held back and one failing (the injected fault)
        def get_many(self, tags, keys, dsts):
            if int(tags[0]) == slow_tag:
                gate.wait(10)
            if int(tags[0]) == failing_tag:
                raise RemoteError("remote tier: injected failure")
            return real.get_many(tags, keys, dsts)

        def close(self):
            pass

    tier = RemoteTier(lambda: Injected(), workers=2, backoff_s=0.01, backoff_max_s=0.02)  # type: ignore[arg-type, return-value]
    try:
        one = lambda tag: tier.submit("get", np.arange(1), np.array([tag], np.uint64),  # noqa: E731
                                      np.array([1], np.uint64), [np.zeros(4096, np.uint8)])
        assert one(slow_tag) is not None and one(failing_tag) is not None
        end = time.monotonic() + 10
        while not tier.degraded and time.monotonic() < end:
            tier.poll(0.01)
        assert tier.degraded and tier.in_flight == 1
        gate.set()
        (late,) = tier.wait(10)
        assert not late.error and tier.degraded  # the older batch's success: stale
        time.sleep(0.03)  # the backoff window ends
        assert one(namespace_tag("fleet", "late-new")) is not None
        (new,) = tier.wait(10)
        assert not new.error and not tier.degraded
    finally:
        gate.set()
        tier.close()
        real.close()


def test_refused_values_of_odd_shapes_are_deleted(redis_cluster):
    """An empty-string header was taken for "no string" and never deleted; a block of more
    parts than Lua can unpack made the delete script fail (and the batch with it)."""
    store = RedisClusterStore(redis_cluster.nodes, password=PW, chunk_bytes=4096)
    tag = namespace_tag("fleet", "odd")
    assert _put(store, tag, [61], _blocks(1, 9000, 8)).all()
    store.client.set(value_name(tag, 61), b"")
    got = store.get_many(np.array([tag], np.uint64), np.array([61], np.uint64), [np.zeros(9000, np.uint8)])
    assert not got.found[0] and got.corrupt == 1
    assert [store.client.exists(value_name(tag, 61, i)) for i in ("h", 0, 1, 2)] == [0, 0, 0, 0]
    big = 9000 * 4096  # 9000 chunks of 4 KiB: past Lua's unpack limit (~8000)
    buf = [np.random.default_rng(9).integers(0, 256, big, dtype=np.uint8)]
    assert _put(store, tag, [62], buf).all()
    store.client.delete(value_name(tag, 62, 4500))  # torn: a miss whose other parts must go
    got = store.get_many(np.array([tag], np.uint64), np.array([62], np.uint64), [np.zeros(big, np.uint8)])
    assert not got.found[0] and got.corrupt == 0
    assert store.client.exists(value_name(tag, 62)) == 0 and store.client.exists(value_name(tag, 62, 8999)) == 0
    store.close()


def test_a_user_without_scripting_still_reads_and_cleans_up(redis_cluster):
    """An ACL user without EVALSHA: the conditional delete is refused. That failed the whole
    batch (the good value in it lost too) and left the corrupt value to fail every batch after;
    now the reads stand and the value is deleted plainly."""
    admin = RedisClusterStore(redis_cluster.nodes, password=PW, chunk_bytes=4096)
    for node in admin.client.get_primaries():
        admin.client.acl_setuser("noscript", enabled=True, passwords=["+noscript-pw"], keys=["*"],
                                 commands=["+@all", "-@scripting"], target_nodes=node)
    store = RedisClusterStore(redis_cluster.nodes, username="noscript", password="noscript-pw", chunk_bytes=4096)
    try:
        tag = namespace_tag("fleet", "noscript")
        bufs = _blocks(2, 9000, 10)
        assert _put(store, tag, [71, 72], bufs).all()
        part = bytearray(admin.client.get(value_name(tag, 72, 1)))
        part[5] ^= 0x02
        admin.client.set(value_name(tag, 72, 1), bytes(part))
        dsts = [np.zeros(9000, np.uint8) for _ in range(2)]
        got = store.get_many(np.full(2, tag, np.uint64), np.array([71, 72], np.uint64), dsts)
        assert got.found.tolist() == [True, False] and got.corrupt == 1 and bytes(dsts[0]) == bufs[0].tobytes()
        assert [admin.client.exists(value_name(tag, 72, i)) for i in ("h", 0, 1, 2)] == [0, 0, 0, 0]
    finally:
        store.close()
        for node in admin.client.get_primaries():
            admin.client.acl_deluser("noscript", target_nodes=node)
        admin.close()
