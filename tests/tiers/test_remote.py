"""The remote tier's store and worker against a real three-shard Redis Cluster."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvtier.kernels.checksum import block_checksum
from kvtier.tiers.remote import RemoteTier, connect_store
from kvtier.tiers.remote_store import RedisClusterStore, RemoteAuthError, namespace_tag, value_name

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
