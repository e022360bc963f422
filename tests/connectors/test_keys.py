"""Engine block hashes as kvtier keys: exact round trips, no folding of distinct hashes."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvtier.client.replies import pack_keys, unpack_ids
from kvtier.connectors.keys import DIGEST_BYTES, block_key, block_keys, digest, hash_bytes
from kvtier.daemon.config import load_config
from kvtier.daemon.service import Service

from ..daemon.service_calls import call, ids

EDGE = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 63) + 1, (1 << 64) - 2, (1 << 64) - 1]
SHA = [hashlib.sha256(bytes([i])).digest() for i in range(4)]


def test_integer_hashes_are_their_own_key_at_the_edges():
    assert [block_key(k) for k in EDGE] == EDGE
    arr = block_keys(EDGE)
    assert arr.dtype == np.uint64 and arr.tolist() == EDGE
    assert unpack_ids(pack_keys(arr), np.uint64).tolist() == EDGE


def test_bytes_and_mixed_lists_round_trip_exactly():
    mixed = [SHA[0], (1 << 64) - 1, SHA[1], 1 << 63, 5, SHA[2]]
    keys = block_keys(mixed)
    want = [int.from_bytes(hashlib.blake2b(h, digest_size=8).digest(), "little") if isinstance(h, bytes) else h
            for h in mixed]
    assert keys.tolist() == want
    assert unpack_ids(pack_keys(keys), np.uint64).tolist() == want  # never through float64


@pytest.mark.parametrize("bad", [-1, 1 << 64, 1.5, "x", True])
def test_a_hash_that_is_neither_bytes_nor_a_uint64_is_refused(bad):
    with pytest.raises(ValueError):
        block_key(bad)


def test_the_digest_holds_the_full_hash():
    for h in [*SHA, *EDGE, b"", b"\xff" * 63]:
        d = digest(h)
        assert len(d) == DIGEST_BYTES and d[1:1 + d[0]] == hash_bytes(h)
    long = b"\x01" * 100
    assert digest(long)[1:33] == hashlib.sha256(long).digest()
    # an int and a bytes hash with the same 64-bit key have different digests
    k = block_key(SHA[3])
    assert block_key(k) == k and digest(k) != digest(SHA[3])


@pytest.fixture
def svc(tmp_path):
    cfg = load_config(environ={}, overrides=[
        "tiers.hbm_bytes=65536", "tiers.dram_bytes=0", "tiers.nvme_bytes=0", 'policy.name="lru"',
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"])
    s = Service(cfg)
    yield s
    s.close()


def test_mixed_keys_seal_and_look_up_exactly_through_the_daemon(svc):
    call(svc, "register", "e", pid=0, block_bytes=4096, namespace="m")
    hashes = [SHA[0], (1 << 63) - 1, 1 << 63, (1 << 64) - 1, SHA[1]]
    keys = block_keys(hashes)
    r = call(svc, "alloc", "e", n=len(hashes), pin=True)
    blocks = ids(r["blocks"])
    sealed = ids(call(svc, "seal", "e", blocks=blocks, keys=pack_keys(keys))["blocks"])
    assert sealed == blocks  # five distinct keys: five blocks, nothing folded
    call(svc, "release", "e", blocks=blocks)
    got = call(svc, "lookup", "e", keys=pack_keys(keys[::-1]))
    assert ids(got["blocks"]) == blocks[::-1]
    assert np.frombuffer(got["tiers"], np.int8).tolist() == [0] * 5
    miss = call(svc, "lookup", "e", keys=pack_keys(block_keys([SHA[2], 7])))
    assert ids(miss["blocks"]) == [-1, -1] and np.frombuffer(miss["tiers"], np.int8).tolist() == [-1, -1]
    assert svc.node.mgr.table.refcount[blocks].tolist() == [1] * 5  # lookup took no reference
