import multiprocessing as mp

import numpy as np
import pytest
import torch

from kvtier.protocol.shm import attach_shm
from kvtier.tiers.pools import DramPool, HbmPool


def _child_writes(name: str, nbytes: int, q) -> None:
    shm = attach_shm(name)
    arr = np.ndarray((nbytes,), dtype=np.uint8, buffer=shm.buf)
    q.put(int(arr[4096 + 5]))
    arr[4096 * 2 + 7] = 42
    del arr
    shm.close()


@pytest.mark.parametrize("kind", ["hbm", "dram"])
def test_pool_is_real_shared_memory(kind):
    pool = HbmPool(3, 1000, device="cpu") if kind == "hbm" else DramPool(3, 1000)
    try:
        assert pool.slot_stride == 4096
        pool.write(1, bytes(range(10)))
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_child_writes, args=(pool.shm_name, pool.capacity_bytes, q))
        p.start(); p.join(30)
        assert p.exitcode == 0 and q.get(timeout=5) == 5
        assert pool.read(2)[7] == 42  # written by another process
        with pytest.raises(ValueError):
            pool.write(0, b"x" * 1001)
        with pytest.raises(ValueError):
            pool.read(3)
    finally:
        pool.close()


def test_external_hbm_tensor():
    t = torch.zeros(2 * 8192, dtype=torch.uint8)
    pool = HbmPool(2, 8000, tensor=t)
    pool.write(1, b"\x07" * 10)
    assert t[8192:8202].tolist() == [7] * 10  # same memory, no copy
    with pytest.raises(ValueError):
        HbmPool(3, 8000, tensor=t)


def test_numa_binding_rejects_missing_node():
    with pytest.raises(ValueError, match="NUMA node"):
        DramPool(1, 4096, numa_node=4096)
