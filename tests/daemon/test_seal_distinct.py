"""Seals with fold_identical_only through a real Service: a block of other bytes under a held
key stays its engine's, out of the index, unannounced, and goes with its last reference."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.protocol import wire as P

from .service_calls import call, hbm_only_service, ids

BB = 4096


@pytest.fixture
def svc(tmp_path):
    s = hbm_only_service(tmp_path, 32, block_bytes=BB)
    call(s, "register", "e", pid=0, block_bytes=BB)
    yield s
    s.close()


def _seal(svc, key, fill, identical_only):
    r = call(svc, "alloc", "e", n=1, seq=key, pin=True)
    b, slot = ids(r["blocks"])[0], ids(r["slots"])[0]
    svc.node.mgr.hbm.tensor[slot, :BB] = fill
    c = ids(call(svc, "seal", "e", blocks=[b], keys=P.id_bytes(np.array([7], np.uint64), np.uint64), seq=key,
                 fold_identical_only=identical_only)["blocks"])[0]
    if c == b:  # a folded block's pins went with it
        call(svc, "release", "e", blocks=[c])
    return b, c


def test_a_block_kept_for_other_bytes_is_neither_announced_nor_cached(svc):
    """Under one key, a block of other bytes sealed with fold_identical_only stays its
    engine's and out of the index: routers hear of the key's held block only, and when the
    kept block's last reference goes it is released (no lookup could ever reach it)."""
    svc.node.events.take_batch()
    first = _seal(svc, 1, 1, True)[1]
    b, kept = _seal(svc, 2, 2, True)
    assert kept == b != first and svc.node.mgr.table.detached[kept]
    b3, folded = _seal(svc, 3, 1, True)  # the same bytes as the first: folds
    assert folded == first
    stored = [e for e in svc.node.events.pending if e[0] == "BlockStored"]
    assert len(stored) == 1  # the first block only
    cached = svc.stats()["blocks"]["cached"]
    call(svc, "free", "e", blocks=[kept])
    assert svc.node.mgr.table.state[kept] == 0 and svc.stats()["blocks"]["cached"] == cached
    assert not [e for e in svc.node.events.pending if e[0] == "BlockRemoved"]  # the key is still held
    assert svc.node.mgr.lookup(int(svc.node.mgr.table.key[first])) == first
    call(svc, "check", "e")
