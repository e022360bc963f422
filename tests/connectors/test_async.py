"""The connector's async path against a real daemon (no vLLM needed): the scheduler half
marks a prefix with a block on NVMe async and one in staging/DRAM sync; the worker half
brings NVMe blocks back between steps, byte for byte, and reports failures (a corrupt
NVMe copy, a block gone) as finished with load errors; saves never wait for staging
room, and a finished request is reported sent only once its queued saves are done."""

from __future__ import annotations

import hashlib
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvtier.bench.spawn import DaemonProcess
from kvtier.bench.vllm_run import corrupt_nvme
from kvtier.connectors.keys import block_keys
from kvtier.connectors.vllm_async import AsyncLoads
from kvtier.connectors.vllm_scheduler import SchedulerSide, Transfer
from kvtier.connectors.vllm_worker import Geometry, WorkerSide

NB, BS, H, D, L = 16, 8, 2, 4, 3
HS = [hashlib.sha256(f"block-{i}".encode()).digest() for i in range(8)]
SLOT = 4096  # a kvtier block here is 1,728 bytes: one page per slot


@pytest.fixture
def rig(tmp_path):
    torch.manual_seed(0)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, NB, BS, H, D) for i in range(L)}
    geo = Geometry(kv, NB)
    # 4 staging slots and 2 DRAM slots: of 8 saved blocks the oldest end up on NVMe only
    d = DaemonProcess(tmp_path, f"tiers.hbm_bytes={4 * SLOT}", f"tiers.dram_bytes={2 * SLOT}",
                      f"tiers.nvme_bytes={64 * 2 * SLOT}", 'policy.name="lru"')
    c = d.client()
    c.register(block_bytes=geo.block_bytes, block_tokens=BS, layout={"layers": L}, namespace="m")
    try:
        yield SimpleNamespace(kv=kv, geo=geo, d=d, c=c, ws=WorkerSide(c, geo, timeout_s=10.0))
    finally:
        c.close()
        d.stop()


def _until(cond, what: str, timeout_s: float = 20.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        out = cond()
        if out:
            return out
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def _on_nvme(r) -> None:
    """Save blocks 1..8 under HS; wait until HS[0], HS[1] are on NVMe only."""
    r.ws.save([Transfer("w", list(range(1, 9)), HS)])  # more than staging holds: some wait for demotions
    _until(lambda: (r.ws.flush(), not r.ws.queue)[1], "the queued saves written")
    assert r.ws.stats["saved_blocks"] == 8
    _until(lambda: bool(np.all(r.c.lookup(block_keys(HS[:2]))[1] == 2)), "the oldest blocks demoted to NVMe")


def _finish(loads: AsyncLoads) -> tuple[set[str], set[int]]:
    def step():
        loads.poll()
        done, errs = loads.take()
        return (done, errs) if done else None
    return _until(step, "the async load finished")


def _request(rid: str, hashes: list, tokens: int) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=tokens, prompt_token_ids=[0] * tokens)


def test_the_scheduler_loads_nvme_prefixes_async_and_staged_ones_sync(rig):
    sched = SchedulerSide(rig.c, BS)
    _on_nvme(rig)
    staged = _request("s", HS[6:8], 3 * BS)
    assert sched.matched(staged, 0) == (2 * BS, False)  # the newest blocks are still in staging
    cold = _request("c", HS[:3], 4 * BS)
    assert sched.matched(cold, 0) == (3 * BS, True)     # its first blocks are on NVMe only
    sched.after_alloc(cold, [10, 11, 12, 13], 3 * BS)
    sched.after_alloc(staged, [4, 5, 6], 2 * BS)
    # nothing scheduled this step: the parked request's load is handed over all the same, once
    nothing = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                              scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                                    num_computed_tokens=[]))
    loads, async_loads, saves = sched.build(nothing)
    assert loads == [] and saves == [] and [(t.req_id, t.block_ids, t.hashes) for t in async_loads] == \
        [("c", [10, 11, 12], HS[:3])]
    assert sched.build(nothing)[1] == []
    assert sched.counts == {"sync_loads": 1, "async_loads": 1}
    delay, params = sched.finished(cold)
    assert delay is False and params == {"kvtier": {"loaded_tokens": 3 * BS, "failed_tokens": 0, "load": "async"}}


def _step(new=(), preempted=()):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=[ids], num_computed_tokens=0) for r, ids in new],
        num_scheduled_tokens={r.request_id: r.num_tokens for r, _ in new}, preempted_req_ids=set(preempted),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]))


def test_vllm_waits_for_a_request_s_saves_unless_it_was_preempted_since(rig):
    """A preempted request's blocks are freed and its queued saves dropped: vLLM must not
    hold it for saves when it finishes (one parked for an async load would be freed twice)."""
    sched = SchedulerSide(rig.c, BS)
    kept, preempted = _request("k", HS[:2], 3 * BS), _request("p", HS[2:4], 3 * BS)
    for r, ids in ((kept, [1, 2, 3]), (preempted, [4, 5, 6])):
        assert sched.matched(r, 0) == (0, False)
        sched.after_alloc(r, ids, 0)
    saves = sched.build(_step(new=[(kept, [1, 2, 3]), (preempted, [4, 5, 6])]))[2]
    assert [(t.req_id, t.block_ids) for t in saves] == [("k", [1, 2]), ("p", [4, 5])]
    preempted.num_preemptions = 1  # vLLM's count; also bumped outside a schedule (reset_prefix_cache)
    assert sched.finished(kept)[0] is True and sched.finished(preempted)[0] is False


def test_a_request_that_saved_again_after_resuming_is_held_for_those_saves(rig):
    sched = SchedulerSide(rig.c, BS)
    r = _request("r", HS[:2], 3 * BS)
    assert sched.matched(r, 0) == (0, False)
    sched.after_alloc(r, [1, 2, 3], 0)
    sched.build(_step(new=[(r, [1, 2, 3])]))
    r.num_preemptions = 1
    sched.after_alloc(r, [7, 8, 9], 0)  # resumed in the same step it was preempted in
    r.block_hashes = HS[:3]
    r.num_tokens = 4 * BS
    assert [t.block_ids for t in sched.build(_step(new=[(r, [7, 8, 9])], preempted={"r"}))[2]] == [[9]]
    assert sched.finished(r)[0] is True


def test_an_nvme_prefix_comes_back_between_steps_byte_for_byte(rig):
    orig = {n: t.clone() for n, t in rig.kv.items()}
    _on_nvme(rig)
    for t in rig.kv.values():
        t[:, 12:15] = 0
    loads = AsyncLoads(rig.c, rig.geo, timeout_s=10.0)
    loads.start([Transfer("r", [12, 13, 14], HS[:3])])
    assert _finish(loads) == ({"r"}, set())
    for n, t in rig.kv.items():
        assert torch.equal(t[:, 12:15], orig[n][:, 1:4])
        assert torch.equal(t[:, :12], orig[n][:, :12]) and torch.equal(t[:, 15:], orig[n][:, 15:])
    assert loads.stats == {"async_loads": 1, "async_loaded_blocks": 3, "async_failed_blocks": 0}
    svc = rig.c.stats()["service"]
    assert svc.get("hits_nvme", 0) >= 2
    assert not loads.pending and rig.c.stats()["service"].get("pinned", 0) == 0  # nothing of ours held


def test_a_corrupt_nvme_copy_finishes_the_load_as_failed_and_writes_nothing(rig):
    _on_nvme(rig)
    assert corrupt_nvme(str(rig.d.nvme_dir), rig.geo.block_bytes) > 0
    before = {n: t.clone() for n, t in rig.kv.items()}
    loads = AsyncLoads(rig.c, rig.geo, timeout_s=10.0)
    loads.start([Transfer("r", [12, 13], HS[:2])])
    assert _finish(loads) == ({"r"}, {12, 13})
    assert all(torch.equal(rig.kv[n], before[n]) for n in rig.kv)  # vLLM recomputes; no byte was written
    assert loads.stats["async_failed_blocks"] == 2
    # a block gone before the load starts (never saved here): failed at once, nothing to wait for
    loads.start([Transfer("q", [3, 4], [HS[0], hashlib.sha256(b"never").digest()])])
    assert loads.take() == ({"q"}, {3, 4}) and not loads.pending
    assert all(torch.equal(rig.kv[n], before[n]) for n in rig.kv)


def test_saves_wait_in_a_queue_not_in_the_forward_and_hold_the_request_until_done(rig):
    ws, c = rig.ws, rig.c
    other = type(c)(runtime_dir=c.runtime_dir)
    try:
        other.register(block_bytes=rig.geo.block_bytes, block_tokens=BS, layout={"layers": L}, namespace="o")
        held, _ = other.alloc(4, pin=True)  # every staging slot pinned by another engine
        ws.save([Transfer("a", [1, 2], HS[:2])])  # returns at once: queued
        assert [q.vid for q in ws.queue] == [1, 2] and ws.stats["save_queued_blocks"] == 2
        assert np.all(c.lookup(block_keys(HS[:2]))[0] == -1)
        assert ws.sent({"a", "z"}) == set()  # finished, but its saves are queued: vLLM keeps its blocks
        ws.save([Transfer("b", [3], HS[2:3])])
        ws.preempted({"b"})  # vLLM frees a preempted request's blocks: its queued save goes
        assert [q.vid for q in ws.queue] == [1, 2] and ws.stats["save_dropped_blocks"] == 1
        impatient = WorkerSide(c, rig.geo, timeout_s=10.0, save_timeout_s=0.0)
        impatient.save([Transfer("c", [4, 5, 6], HS[3:6])])  # no room within its timeout: dropped, counted
        assert not impatient.queue and impatient.stats["save_dropped_blocks"] == 3
        assert impatient.stats["saved_blocks"] == 0 and impatient.sent({"c"}) == {"c"}
        other.release(blocks=held)
        other.free(blocks=held)
        assert _until(lambda: ws.sent(set()), "room for the queued saves") == {"a"}
        assert ws.sent({"b"}) == set() and not ws.queue and ws.saving == set()  # preempted: not waited for
        assert np.all(c.lookup(block_keys(HS[:2]))[0] >= 0) and ws.stats["saved_blocks"] == 2
    finally:
        other.close()


def test_the_daemon_hears_each_saved_blocks_request_features_and_shared_prefixes(rig):
    sched = SchedulerSide(rig.c, BS)
    first = _request("a", HS[:3], 3 * BS + 1)
    assert sched.matched(first, 0) == (0, False) and sched.reqs["a"].system == 0
    rig.ws.save([Transfer("a", [1, 2, 3], HS[:3], ["user"] * 3, cont=False, span=3)])
    # another conversation with the same first two blocks: they are a shared (system) prefix
    other = _request("b", HS[:2] + [HS[5], HS[6], HS[7]], 5 * BS + 1)
    assert sched.matched(other, 0) == (2 * BS, False)
    st = sched.reqs["b"]
    assert (st.system, st.cont, st.span) == (2, True, 3)
    rig.ws.save([Transfer("b", [4, 5, 6], [HS[5], HS[6], HS[7]], ["user"] * 3, cont=True, span=3)])
    want = [0] * 16
    want[1] = 3  # a: not a continuation, 2-4 new blocks
    want[4 + 1] = 3  # b: continues (its first two blocks were held), 2-4 new blocks (saved one by one)
    _until(lambda: (rig.ws.flush(), not rig.ws.queue)[1], "the queued saves written")
    _until(lambda: rig.c.stats()["feature_classes"] == want, "the class reports applied")
    _until(lambda: rig.c.stats()["segments"].get("system") == 2, "the shared prefix re-tagged system")


def test_with_tensor_parallel_ranks_a_block_is_a_hit_only_where_every_rank_holds_it(rig):
    """Each rank saves its own shard under its own namespace; the scheduler asks them all."""
    c0 = rig.c  # rank 0's namespace is "m"
    c1 = type(c0)(runtime_dir=c0.runtime_dir)
    try:
        c1.register(block_bytes=rig.geo.block_bytes, block_tokens=BS, layout={"layers": L}, namespace="m:tp1")
        ws1 = WorkerSide(c1, rig.geo, timeout_s=10.0)
        sched = SchedulerSide([c0, c1], BS)
        rig.ws.save([Transfer("a", [1, 2, 3], HS[:3])])      # rank 0 holds 3 blocks
        ws1.save([Transfer("a", [1, 2], HS[:2])])            # rank 1 only 2
        for w in (rig.ws, ws1):
            _until(lambda w=w: (w.flush(), not w.queue)[1], "the saves written")
        # (which tier each block is in depends on demotions: the counts are what is asserted)
        assert sched.matched(_request("r", HS[:3], 4 * BS), 0)[0] == 2 * BS
        assert SchedulerSide([c0], BS).matched(_request("q", HS[:3], 4 * BS), 0)[0] == 3 * BS
        assert sched.matched(_request("s", HS[2:3], 2 * BS), 0) == (0, False)  # rank 1 lacks it
        ws1.save([Transfer("b", [3], HS[2:3])])
        _until(lambda: (ws1.flush(), not ws1.queue)[1], "the save written")
        assert sched.matched(_request("t", HS[:3], 4 * BS), 0)[0] == 3 * BS
    finally:
        c1.close()
