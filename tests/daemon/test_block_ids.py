"""A block table smaller than the tiers' slots (``tiers.max_blocks``): an alloc that finds no
free id drops cached blocks for one, never a live one, and says so when every id is live."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.daemon.config import load_config
from kvtier.daemon.service import Service
from kvtier.protocol import wire as P
from kvtier.protocol.wire import ProtocolError
from kvtier.tiers.types import DRAM, HBM

from .service_calls import call, ids

BB = 4096


def _service(tmp_path, *extra: str) -> Service:
    return Service(load_config(environ={}, overrides=[
        f"tiers.hbm_bytes={8 * BB}", f"tiers.dram_bytes={8 * BB}", "tiers.nvme_bytes=0", "tiers.max_blocks=4",
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false", *extra]))


def _cached(svc: Service, key: int) -> int:
    """A block sealed under ``key``, released and freed: cached, held by nobody."""
    r = call(svc, "alloc", "e", n=1, pin=True)
    b = ids(r["blocks"])[0]
    svc.node.mgr.hbm.host_view(ids(r["slots"])[0])[:] = key
    b = ids(call(svc, "seal", "e", blocks=[b], keys=P.id_bytes(np.array([key], dtype=np.uint64), np.uint64))
            ["blocks"])[0]
    call(svc, "release", "e", blocks=[b])
    call(svc, "free", "e", blocks=[b])
    return b


def test_a_full_table_of_cached_blocks_gives_ids_to_new_allocs(tmp_path):
    svc = _service(tmp_path)
    try:
        call(svc, "register", "e", pid=0, block_bytes=BB)
        mgr = svc.node.mgr
        cached = [_cached(svc, k) for k in (11, 12, 13)]
        mgr.demote([cached[0]], HBM, DRAM)  # one in DRAM only: DRAM's victims go before HBM's
        mgr.wait()
        live = ids(call(svc, "alloc", "e", n=1)["blocks"])  # all 4 ids taken; HBM has room
        assert len(mgr.table.free_blocks) == 0 and mgr.table.free_slot_count(HBM) > 0
        got = ids(call(svc, "alloc", "e", n=2, wait=False)["blocks"])  # before: "no room in HBM", every time
        assert len(got) == 2 and cached[0] in got and live[0] not in got  # the DRAM-only one went first
        assert mgr.table.refcount[live[0]] == 1  # the live block stayed
        assert svc.node.placement.dropped == 2
        assert call(svc, "check", "x")["ok"]
        with pytest.raises(ProtocolError) as e:  # every id now live: named as such, not as HBM
            call(svc, "alloc", "e", n=2, wait=False)
        assert e.value.code == P.NO_SPACE and "no free block ids" in e.value.message
    finally:
        svc.close()
