import numpy as np
import pytest

from kvtier.tiers.key_index import KeyIndex


def test_randomized_against_dict():
    rng = np.random.default_rng(3)
    idx = KeyIndex(500)
    ref: dict[int, int] = {}
    keys = rng.integers(0, 2**64 - 1, 800, dtype=np.uint64).tolist() + [0, 2**64 - 1]
    for step in range(20000):
        k = keys[int(rng.integers(0, len(keys)))]
        if rng.random() < 0.55 and k not in ref and len(ref) < 500:
            v = int(rng.integers(0, 1 << 30))
            idx.insert(k, v); ref[k] = v
        elif k in ref:
            assert idx.pop(k) == ref.pop(k)
        else:
            assert idx.pop(k) == -1
        if step % 1000 == 0:
            q = np.array(keys, dtype=np.uint64)
            exp = np.array([ref.get(x, -1) for x in keys])
            assert np.array_equal(idx.get_many(q), exp)
    assert len(idx) == len(ref)
    for k, v in ref.items():
        assert idx.get(k) == v


def test_duplicate_and_full():
    idx = KeyIndex(2)
    idx.insert(5, 1)
    with pytest.raises(ValueError):
        idx.insert(5, 2)
    idx.insert(6, 2)
    with pytest.raises(ValueError):
        idx.insert(7, 3)
    assert idx.get(5) == 1 and idx.get(6) == 2 and 7 not in idx
