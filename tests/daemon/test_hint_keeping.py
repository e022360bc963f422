"""Hints and deferred accesses against the daemon's bookkeeping: a hint survives disk
pressure and a small budget, and an access logged for a freed block does not pass to
the next block that takes its id."""

from __future__ import annotations

import numpy as np

from kvtier.daemon.config import load_config
from kvtier.daemon.service import Service
from kvtier.protocol.wire import ProtocolError

from .service_calls import Clock, call, ids, pump


def three_tiers(tmp_path, hbm: int, dram: int, nvme: int, *extra: str, block: int = 4096,
                clock: Clock) -> Service:
    cfg = load_config(environ={}, overrides=[
        f"tiers.hbm_bytes={hbm * block}", f"tiers.dram_bytes={dram * block}", f"tiers.nvme_bytes={nvme * block}",
        f'tiers.nvme_dir="{tmp_path}/nvme"', f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false",
        *extra])
    s = Service(cfg, clock=clock)
    call(s, "register", "e", pid=0, block_bytes=block)
    return s


def sealed(s: Service, n: int, keys: list[int]) -> list[int]:
    """Alloc and seal ``n`` blocks under ``keys`` (waiting for demotions to make room)."""
    for _ in range(20):
        try:
            blocks = ids(call(s, "alloc", n=n)["blocks"])
            break
        except ProtocolError:
            pump(s)
    else:
        raise AssertionError("no room")
    return ids(call(s, "seal", blocks=blocks, keys=keys)["blocks"])


def cached(s: Service, n: int, keys: list[int]) -> list[int]:
    """Sealed blocks freed at once: cached under ``keys``, in no engine's hands."""
    out = sealed(s, n, keys)
    call(s, "free", blocks=out)
    return out


def test_a_hinted_block_on_nvme_is_not_the_one_dropped_for_room(tmp_path):
    clock = Clock()
    s = three_tiers(tmp_path, 2, 2, 8, "policy.prefetch_budget_bytes_per_s=1", clock=clock)  # no prefetch
    try:
        t = s.node.mgr.table
        keys = iter(range(1, 100))
        for _ in range(6):
            cached(s, 2, [next(keys), next(keys)])
            pump(s)
            clock.t += 1
        on_disk = t.nvme_idle.to_array().tolist()
        assert len(on_disk) == 8 and all(t.copies[b] == 4 for b in on_disk)  # NVMe full, NVMe-only
        oldest = on_disk[0]
        key, next_key = int(t.key[oldest]), int(t.key[on_disk[1]])
        call(s, "hint", blocks=[oldest], deadline_s=600.0)
        cached(s, 2, [next(keys), next(keys)])  # two more demoted down: two disk slots wanted
        pump(s)
        assert t.lookup(key) == oldest and t.copies[oldest] == 4  # the hinted block kept its copy
        assert s.node.placement.dropped == 4
        assert t.lookup(next_key) == -1  # the next oldest went in its place
        s.node.mgr.check_invariants()
    finally:
        s.close()


def test_a_budget_under_a_block_per_burst_still_prefetches(tmp_path):
    """1 MB/s banks 50 KB per 50 ms, less than a 64 KiB block: the bank holds a block at least."""
    clock = Clock()
    block = 65536
    s = three_tiers(tmp_path, 4, 8, 0, "policy.prefetch_budget_bytes_per_s=1e6", block=block, clock=clock)
    try:
        t = s.node.mgr.table
        first = sealed(s, 4, [1, 2, 3, 4])
        pump(s)
        clock.t += 1
        second = sealed(s, 4, [5, 6, 7, 8])
        pump(s)
        out = [b for b in first + second if not t.copies[b] & 1]
        assert out
        call(s, "hint", blocks=out[:1], deadline_s=60.0)
        for _ in range(200):  # 2 s of idle turns, long before the deadline
            clock.t += 0.01
            s.maintain()
            s.node.mgr.wait(timeout=5)
            s.background()
        assert s.node.prefetcher.started == 1 and t.copies[out[0]] & 1
    finally:
        s.close()


def test_an_access_logged_for_a_freed_block_is_not_credited_to_its_ids_next_block(tmp_path):
    clock = Clock()
    s = three_tiers(tmp_path, 4, 4, 0, clock=clock)
    try:
        placement = s.node.placement
        model = placement.policies[0].model
        first = ids(call(s, "alloc", n=1)["blocks"])[0]
        assert model.count[first] == 1  # a fresh block: its alloc is its one access
        call(s, "free", blocks=[first])
        b = ids(call(s, "alloc", n=1)["blocks"])[0]
        clock.t += 2.0
        s.background()
        call(s, "acquire", blocks=[b], wait=False)  # logged, applied at the next idle drain
        call(s, "release", blocks=[b])
        assert placement.backlog == 1
        call(s, "free", blocks=[b])
        while True:  # the free list is FIFO: cycle until b's id comes back
            n = ids(call(s, "alloc", n=1)["blocks"])[0]
            if n == b:
                break
            call(s, "free", blocks=[n])
        s.background()
        assert placement.backlog == 0
        assert model.count[b] == 1  # its own alloc only, not the freed block's acquire
        s.node.mgr.check_invariants()
    finally:
        s.close()


def test_drained_accesses_still_reach_live_blocks(tmp_path):
    """The generation filter skips only freed blocks: a live block's logged access counts."""
    clock = Clock()
    s = three_tiers(tmp_path, 4, 4, 0, clock=clock)
    try:
        model = s.node.placement.policies[0].model
        b = ids(call(s, "alloc", n=1)["blocks"])[0]
        call(s, "seal", blocks=[b], keys=[7])
        clock.t += 2.0
        call(s, "acquire", blocks=[b], wait=False)
        call(s, "release", blocks=[b])
        s.background()
        assert model.count[b] == 2 and np.all(s.node.placement._log_n == 0)
    finally:
        s.close()
