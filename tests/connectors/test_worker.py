"""The connector's worker half against a real daemon: vLLM-shaped KV tensors (no vLLM needed)
saved to kvtier and loaded back into other blocks, byte for byte; a key collision or a
missing block is reported for recomputation and never written into vLLM's KV."""

from __future__ import annotations

import hashlib
import logging

import pytest
import torch

from kvtier.bench.spawn import DaemonProcess
from kvtier.connectors.keys import block_key
from kvtier.connectors.vllm_scheduler import Transfer
from kvtier.connectors.vllm_worker import Geometry, WorkerSide

NB, BS, H, D, L = 16, 8, 2, 4, 3
HS = [hashlib.sha256(f"block-{i}".encode()).digest() for i in range(6)]


@pytest.fixture
def worker(tmp_path):
    torch.manual_seed(0)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, NB, BS, H, D) for i in range(L)}  # blocks on dim 1
    geo = Geometry(kv, NB)
    d = DaemonProcess(tmp_path, f"tiers.hbm_bytes={8 * 4096 * 2}", f"tiers.dram_bytes={4 * 4096 * 2}",
                      f"tiers.nvme_bytes={32 * 4096 * 3}")
    c = d.client()
    c.register(block_bytes=geo.block_bytes, block_tokens=BS, layout={"layers": L}, namespace="m")
    try:
        yield kv, WorkerSide(c, geo, timeout_s=10.0), c
    finally:
        c.close()
        d.stop()


def _load(ws, kv, transfers):
    ws.start(transfers)
    for name in kv:
        ws.wait_layer(name)
    ws.finish_load()
    return ws.take_errors()


def test_saved_blocks_come_back_byte_for_byte_into_other_blocks(worker):
    kv, ws, c = worker
    orig = {n: t.clone() for n, t in kv.items()}
    ws.save([Transfer("a", [1, 2, 3, 4, 5, 6], HS)])
    for t in kv.values():
        t[:, 8:14] = 0
    assert _load(ws, kv, [Transfer("b", [8, 9, 10], HS[:3]), Transfer("c", [11, 12, 13], HS[3:])]) == set()
    for n, t in kv.items():
        assert torch.equal(t[:, 8:14], orig[n][:, 1:7])
        assert torch.equal(t[:, :8], orig[n][:, :8]) and torch.equal(t[:, 14:], orig[n][:, 14:])
    assert c.stats()["service"]["hits_hbm"] + c.stats()["service"].get("hits_dram", 0) + \
        c.stats()["service"].get("hits_nvme", 0) >= 6


def test_a_hash_colliding_in_64_bits_is_refused_not_served(worker):
    kv, ws, _ = worker
    ws.save([Transfer("a", [1], HS[:1])])
    twin = block_key(HS[0])  # an integer hash with the very same 64-bit key, a different block
    before = {n: t[:, 15].clone() for n, t in kv.items()}
    assert _load(ws, kv, [Transfer("b", [15], [twin])]) == {15}
    assert all(torch.equal(kv[n][:, 15], before[n]) for n in kv)  # nothing written
    assert _load(ws, kv, [Transfer("c", [14], HS[:1])]) == set()  # the real owner still loads
    assert all(torch.equal(kv[n][:, 14], kv[n][:, 1]) for n in kv)


def test_a_block_kvtier_does_not_hold_is_reported_and_saves_of_that_request_are_skipped(worker):
    kv, ws, c = worker
    ws.start([Transfer("r", [3, 4], [HS[0], HS[1]])])
    ws.finish_load()
    assert ws.take_errors() == {3, 4}
    ws.save([Transfer("r", [5], HS[5:])])  # computed on top of a failed load: not saved
    ws.save([Transfer("s", [6], HS[4:5])])  # another request's, same step: it may share the failed blocks
    got, _ = c.lookup([block_key(HS[5]), block_key(HS[4])])
    assert (got == -1).all()


def test_saves_are_dropped_until_vllm_has_heard_of_a_failed_load(worker):
    """vLLM learns of a failed load from the step's output, and with async scheduling the next
    step is already scheduled: blocks computed in both may attend to bytes never loaded. A seal
    would keep them for every later request (a correct re-save folds into the sealed copy)."""
    kv, ws, c = worker
    ws.start([Transfer("a", [1, 2], HS[:2])])  # kvtier holds neither: the load fails
    ws.finish_load()
    assert ws.take_errors() == {1, 2}
    for t in kv.values():
        t[:, 3] = 666.0  # another request computed block 3 on top of the failed blocks
    ws.save([Transfer("b", [3], HS[2:3])])
    ws.start([])  # the next step, scheduled before vLLM processed the failure
    ws.finish_load()
    for t in kv.values():
        t[:, 4] = 777.0
    ws.save([Transfer("a", [4], HS[3:4])])
    ws.start([])  # vLLM has rewound both requests: what they compute now is sound
    ws.finish_load()
    for t in kv.values():
        t[:, 3] = 1.0
    ws.save([Transfer("b", [3], HS[2:3])])
    got, _ = c.lookup([block_key(h) for h in HS[2:4]])
    assert got[0] >= 0 and got[1] == -1
    for t in kv.values():
        t[:, 10] = 0
    assert _load(ws, kv, [Transfer("c", [10], HS[2:3])]) == set()
    assert all(bool((t[:, 10] == 1.0).all()) for t in kv.values())  # the recomputed bytes, not 666


def test_one_hash_twice_in_a_save_batch_is_saved_once_and_nothing_leaks(worker):
    kv, ws, c = worker
    ws.save([Transfer("a", [1], HS[:1]), Transfer("b", [2], HS[:1])])  # identical prompts, one step
    assert ws.stats["saved_blocks"] == 1 and ws.stats["save_dropped_blocks"] == 1
    (me,) = [e for e in c.stats()["engines"] if e["engine"] == c.engine_id]
    assert me["live_blocks"] == 0 and me["pins"] == 0  # the sealed block is cached, no one holds it
    assert _load(ws, kv, [Transfer("c", [9], HS[:1])]) == set()
    assert all(torch.equal(t[:, 9], t[:, 1]) for t in kv.values())


def test_a_second_model_with_its_own_geometry_shares_the_daemon(worker):
    kv, ws, c = worker
    small = {f"m2.layers.{i}": torch.randn(NB, 2, BS, 1, D) for i in range(2)}  # another model: blocks on dim 0
    geo2 = Geometry(small, NB)
    c2 = type(c)(runtime_dir=c.runtime_dir)
    try:
        info = c2.register(block_bytes=geo2.block_bytes, block_tokens=BS, layout={"layers": 2}, namespace="m2")
        assert info["block_bytes"] == geo2.block_bytes < info["slot_bytes"]
        ws2 = WorkerSide(c2, geo2, timeout_s=10.0)
        assert not ws2.layerwise  # the daemon's parts are the first model's
        ws.save([Transfer("a", [1], HS[:1])])
        ws2.save([Transfer("x", [2], HS[:1])])  # the same hash in another namespace: its own block
        orig = {n: t[2].clone() for n, t in small.items()}
        assert _load(ws2, small, [Transfer("y", [7], HS[:1])]) == set()
        assert all(torch.equal(small[n][7], orig[n]) for n in small)
        assert _load(ws, kv, [Transfer("z", [9], HS[:1])]) == set()
        assert all(torch.equal(kv[n][:, 9], kv[n][:, 1]) for n in kv)
    finally:
        c2.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_the_scheduler_registers_the_block_size_its_rank_s_worker_will(tp):
    """vLLM builds a spec from one rank's KV heads, and the worker packs every layer of every
    group. The scheduler divided the page by the TP size again and counted one group's layers:
    a narrower size than the worker's (a wider one would have become the namespace's tag)."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvtier.connectors.vllm import scheduler_geometry

    heads, head_size, tokens, blocks = 4 // tp, 8, 16, 5  # 4 KV heads over tp ranks
    spec = FullAttentionSpec(block_size=tokens, num_kv_heads=heads, head_size=head_size, dtype=torch.float32)
    window = FullAttentionSpec(block_size=tokens, num_kv_heads=heads, head_size=head_size, dtype=torch.float32,
                               sliding_window=32)
    groups = [KVCacheGroupSpec([f"full.{i}" for i in range(3)], spec),
              KVCacheGroupSpec([f"window.{i}" for i in range(2)], window)]
    config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    kv = {name: torch.zeros(2, blocks, tokens, heads, head_size) for g in groups for name in g.layer_names}
    kv["shared.0"] = kv["full.1"]  # cross-layer KV sharing: vLLM hands the worker the target's tensor,
    # and leaves the layer out of the scheduler's groups
    worker = Geometry(kv, blocks)
    assert scheduler_geometry(config) == (len(worker.layers), worker.block_bytes) == (5, worker.block_bytes)
    assert worker.index["shared.0"] == worker.index["full.1"]  # its load waits on its target's


def test_a_failure_found_after_vllm_took_the_step_s_errors_taints_one_step_more(worker):
    """With speculative decoding vLLM takes a step's load errors before ``wait_for_save``
    finishes the step's loads: a failure found there reaches vLLM a step later."""
    kv, ws, c = worker
    ws.save([Transfer("a", [1], HS[:1])])
    ws.start([Transfer("b", [15], [block_key(HS[0])])])  # same 64-bit key, another hash
    assert ws.take_errors() == set()  # vLLM asks before the deferred save
    ws.finish_load()  # the mismatch is found here
    got = _save_one_block_a_step_from_here(ws, c)
    assert (got[:3] == -1).all() and got[3] >= 0  # this step, and the two vLLM scheduled before it heard


def _save_one_block_a_step_from_here(ws, c):
    """Saves HS[1..4], one a step, in vLLM's speculative-decoding order; what kvtier holds."""
    ws.save([Transfer("c", [3], HS[1:2])])
    for s in [[Transfer("c", [4], HS[2:3])], [Transfer("d", [5], HS[3:4])], [Transfer("e", [6], HS[4:5])]]:
        ws.take_errors()
        ws.start([])
        ws.finish_load()
        ws.save(s)
    got, _ = c.lookup([block_key(h) for h in HS[1:5]])
    return got


@pytest.mark.parametrize("peer_window,dropped", [(-1, 0), (0, 1), (1, 2), (2, 3)])
def test_a_tensor_parallel_peer_s_window_is_this_rank_s(worker, peer_window, dropped):
    """The group's verdict (a peer's failure: the steps after this one it taints) drops the
    same saves here, though this rank's own loads went well."""
    kv, ws, c = worker
    told = []

    def agree(mine):  # what the all-reduce returns: the most any rank still drops
        told.append(mine)
        return max(mine, peer_window) if len(told) == 1 else mine
    ws.agree = agree
    ws.start([])
    ws.finish_load()
    got = _save_one_block_a_step_from_here(ws, c)
    assert told == [-1] + [max(peer_window - k, -1) for k in (1, 2, 3)]  # once a step, relative to it
    assert (got[:dropped] == -1).all() and (got[dropped:] >= 0).all()
    assert ws.stats["save_dropped_blocks"] == dropped


def test_an_agreement_that_fails_drops_this_step_s_saves(worker):
    """A broken group cannot say whether a peer failed: this step is tainted as if one had."""
    kv, ws, c = worker

    def broken(mine):
        raise RuntimeError("injected: gloo connection reset")
    ws.agree = broken
    ws.start([])
    ws.finish_load()
    ws.save([Transfer("c", [3], HS[1:2])])
    ws.agree = None
    for i in (2, 3):
        ws.start([])
        ws.finish_load()
        ws.save([Transfer("c", [i + 2], HS[i:i + 1])])
    got, _ = c.lookup([block_key(h) for h in HS[1:4]])
    assert got.tolist()[:2] == [-1, -1] and got[2] >= 0  # this step and the next, as a failed load
    assert ws.stats["taint_agreement_failures"] == 1


def test_a_group_that_stays_broken_is_logged_rarely_and_counted(worker, caplog):
    """A broken group fails every step: each step's saves are dropped and counted, but the log
    says so at the 1st, 2nd, 4th, 8th... failure in a row, and once when it works again."""
    kv, ws, c = worker

    def broken(mine):
        raise RuntimeError("injected: gloo connection reset")
    ws.agree = broken
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        for _ in range(20):
            ws.start([])
            ws.finish_load()
            ws.save([])
        ws.agree = lambda mine: mine
        ws.start([])
        ws.finish_load()
        ws.save([])
    said = [r.getMessage() for r in caplog.records if "taint agreement" in r.getMessage()]
    assert [m.split(", ")[-1].split(" step")[0] for m in said[:-1]] == ["1", "2", "4", "8", "16"]
    assert said[-1].endswith("works again after 20 failed step(s)")
    assert ws.stats["taint_agreement_failures"] == 20


@pytest.mark.parametrize("preempted,held", [(set(), [True, True]), ({"c"}, [False, True])])
def test_a_step_vllm_never_finalized_is_saved_when_the_next_one_begins(worker, preempted, held):
    """With speculative decoding vLLM 0.32 never calls ``wait_for_save`` on a pipeline stage
    before the last: the next step's ``handle_preemptions`` finishes the load and makes the
    saves, less those of requests preempted now (their blocks are vLLM's again)."""
    kv, ws, c = worker
    orig = {n: t.clone() for n, t in kv.items()}
    ws.save([Transfer("a", [1, 2], HS[:2])])
    for t in kv.values():
        t[:, 8:10] = 0
    ws.start([Transfer("b", [8, 9], HS[:2])], saves=[Transfer("c", [3], HS[2:3]), Transfer("d", [4], HS[3:4])])
    for name in kv:
        ws.wait_layer(name)
    ws.preempted(preempted)  # the next step begins; no wait_for_save came
    (engine,) = c.stats()["engines"]
    assert engine["pins"] == 0 and engine["live_blocks"] == 0
    for n, t in kv.items():
        assert torch.equal(t[:, 8:10], orig[n][:, 1:3])
        t[:, 3:5] = 7.0  # this step's forward writes blocks again: the saves were made before it
    ws.start([])
    ws.finish_load()
    ws.save([])  # flushes what waited for staging room
    got, _ = c.lookup([block_key(h) for h in HS[2:4]])
    assert (got >= 0).tolist() == held
    assert _load(ws, kv, [Transfer("x", [12], HS[3:4])]) == set()
    for n, t in kv.items():
        assert torch.equal(t[:, 12], orig[n][:, 4])
    assert ws.stats["save_dropped_blocks"] == held.count(False)
    assert ws.sent({"c", "d"}) == {"c", "d"} - preempted  # a preempted one is not waited for (the scheduler's side)
    c.check()


def test_a_load_vllm_never_finished_is_finished_at_the_next_step(worker):
    """Without a ``handle_preemptions`` between them either, the next step's start releases
    the load's pins and refs (or they leak) and drops the saves (the forward may have
    overwritten their blocks already)."""
    kv, ws, c = worker
    orig = {n: t.clone() for n, t in kv.items()}
    ws.save([Transfer("a", [1, 2], HS[:2])])
    for t in kv.values():
        t[:, 8:10] = 0
    ws.start([Transfer("b", [8, 9], HS[:2])], saves=[Transfer("c", [3], HS[2:3])])
    for name in kv:
        ws.wait_layer(name)
    ws.start([])  # no finish_load, no save in between
    assert ws.stats["save_dropped_blocks"] == 1
    assert ws.sent({"c"}) == {"c"}  # dropped, and reported done: vLLM may free its blocks
    (engine,) = c.stats()["engines"]
    assert engine["pins"] == 0 and engine["live_blocks"] == 0
    for n, t in kv.items():
        assert torch.equal(t[:, 8:10], orig[n][:, 1:3])
    assert ws.take_errors() == set() and ws.stats["loaded_blocks"] == 2
    c.check()


def test_a_save_queued_for_staging_room_is_dropped_when_its_request_is_preempted(worker):
    """Staging full: the step's saves wait in the queue. A preemption then gives the request's
    blocks back to vLLM, so its queued saves must never run (they would read whatever vLLM
    wrote there next); the other request's still do once room comes back."""
    from kvtier.client.replies import RequestRejected

    kv, ws, c = worker
    orig = {n: t.clone() for n, t in kv.items()}
    held = []
    while True:  # pin every staging slot
        try:
            held.append(c.alloc(1, pin=True, wait=False)[0])
        except RequestRejected:
            break
    ws.save([Transfer("c", [3], HS[2:3]), Transfer("d", [4], HS[3:4])])
    assert ws.stats["saved_blocks"] == 0 and len(ws.queue) == 2
    ws.preempted({"c"})
    for t in kv.values():
        t[:, 3] = 7.0  # vLLM reuses the preempted request's block at once
    for b in held:
        c.release(blocks=b)
        c.free(blocks=b)
    ws.save([])  # room again: the queue drains
    got, _ = c.lookup([block_key(h) for h in HS[2:4]])
    assert (got >= 0).tolist() == [False, True]
    assert ws.stats["save_dropped_blocks"] == 1 and ws.stats["saved_blocks"] == 1
    assert ws.sent({"c", "d"}) == {"d"}  # the preempted one is no longer waited for
    assert _load(ws, kv, [Transfer("x", [12], HS[3:4])]) == set()
    for n, t in kv.items():
        assert torch.equal(t[:, 12], orig[n][:, 4])
    c.check()


def test_a_load_of_a_step_without_saves_is_finished_when_the_next_step_begins(worker):
    """A step with loads and no saves on a stage vLLM never finalizes: ``handle_preemptions``
    of the next step finishes the load (pins and refs go, the bytes are in place) before that
    step's ``start``, not only through ``start``'s fallback."""
    kv, ws, c = worker
    orig = {n: t.clone() for n, t in kv.items()}
    ws.save([Transfer("a", [1, 2], HS[:2])])
    for t in kv.values():
        t[:, 8:10] = 0
    ws.start([Transfer("b", [8, 9], HS[:2])])
    for name in kv:
        ws.wait_layer(name)
    ws.preempted(set())
    assert ws.load is None and ws.stats["loaded_blocks"] == 2
    (engine,) = c.stats()["engines"]
    assert engine["pins"] == 0 and engine["live_blocks"] == 0
    for n, t in kv.items():
        assert torch.equal(t[:, 8:10], orig[n][:, 1:3])
    assert ws.stats["save_dropped_blocks"] == 0
    c.check()
