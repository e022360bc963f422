"""Keys go on the wire as exact uint64: no float64 detour, no silent wrap-around."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.client.replies import pack_ids, pack_keys

M64 = (1 << 64) - 1
EDGES = [0, 7, 2**63 - 1, 2**63, M64]


def unpack(b: bytes) -> list[int]:
    return [int(v) for v in np.frombuffer(b, dtype="<u8")]


@pytest.mark.parametrize("keys", [
    EDGES,
    [0xE000000000000001, 7],  # mixed >= 2**63 and < 2**63: np.asarray made this float64
    [0xE000000000000002, 8],
    [7, 0xE000000000000001],
    [2**63, 2**63 + 1, 2**63 + 2],
    [np.uint64(M64), 1, np.int64(5)],  # numpy scalars mixed with Python ints
])
def test_lists_pack_exactly(keys):
    want = [int(k) for k in keys]
    assert unpack(pack_keys(keys)) == want
    assert unpack(pack_ids(keys, np.uint64)) == want  # every key-carrying call goes through this


def test_neighbouring_large_keys_stay_distinct():
    a = unpack(pack_ids([0xE000000000000001, 7], np.uint64))
    b = unpack(pack_ids([0xE000000000000002, 8], np.uint64))
    assert a[0] == 0xE000000000000001 and b[0] == 0xE000000000000002 and a[0] != b[0]


def test_arrays_and_scalars():
    assert unpack(pack_keys(np.array(EDGES, dtype=np.uint64))) == EDGES
    assert unpack(pack_keys(np.array([0, 7, 2**63 - 1], dtype=np.int64))) == [0, 7, 2**63 - 1]
    # an int64 array is the signed view of uint64 keys (vLLM hashes, our KV events): lossless
    signed = np.array([-1, -(2**63), 3], dtype=np.int64)
    assert unpack(pack_keys(signed)) == [M64, 2**63, 3]
    assert unpack(pack_keys([np.int64(-1), 2**63])) == [M64, 2**63]
    big = np.array([0xE000000000000001, 0xE000000000000002], dtype=np.uint64)
    assert unpack(pack_keys(big.view(np.int64))) == [0xE000000000000001, 0xE000000000000002]
    assert unpack(pack_keys(np.array([[1, 2], [3, 4]], dtype=np.uint32))) == [1, 2, 3, 4]
    assert unpack(pack_keys(2**64 - 1)) == [M64]
    assert unpack(pack_keys(np.uint64(2**63))) == [2**63]
    assert pack_keys([]) == b""
    assert pack_keys(np.zeros(0, dtype=np.uint64)) == b""
    assert pack_keys(None) is None
    raw = pack_keys(np.array([2**63 + 5], dtype=">u8"))  # big-endian input still goes out little-endian
    assert raw == (2**63 + 5).to_bytes(8, "little")


@pytest.mark.parametrize("bad", [
    [-1], [2**64], [1.5], [1, 2.0], -1, 2**64, 1.5, [True], ["7"],
    [np.float64(3.0)], np.array([1.0, 2.0]), np.array([True]), np.array(["1"]),
])
def test_rejects_what_is_not_a_uint64(bad):
    with pytest.raises(ValueError):
        pack_keys(bad)
    with pytest.raises(ValueError):
        pack_ids(bad, np.uint64)
