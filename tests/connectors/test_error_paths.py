"""The connector's error paths against a real daemon: a refused seal leaks no staging pins, a
load that failed is not offered again for ever, a prefix is never offered larger than staging,
and async loads of a session the daemon reclaimed never touch the new session's blocks."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import torch

from kvtier.bench.spawn import DaemonProcess
from kvtier.client.replies import RequestRejected
from kvtier.connectors.keys import block_keys
from kvtier.connectors.vllm_async import AsyncLoads
from kvtier.connectors.vllm_scheduler import SchedulerSide, Transfer
from kvtier.connectors.vllm_worker import Geometry, WorkerSide

from .test_async import _request

NB, BS, H, D, L = 16, 8, 2, 4, 3
HS = [hashlib.sha256(f"block-{i}".encode()).digest() for i in range(16)]
SLOT = 4096


def _rig(tmp_path, *extra, env=None, heartbeat_s=1.0):
    torch.manual_seed(0)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, NB, BS, H, D) for i in range(L)}
    geo = Geometry(kv, NB)
    d = DaemonProcess(tmp_path, f"tiers.hbm_bytes={4 * SLOT}", f"tiers.dram_bytes={2 * SLOT}",
                      f"tiers.nvme_bytes={64 * 2 * SLOT}", 'policy.name="lru"', *extra, env=env)
    c = d.client(heartbeat_s=heartbeat_s)
    c.register(block_bytes=geo.block_bytes, block_tokens=BS, layout={"layers": L}, namespace="m")
    return geo, d, c


def _held(c) -> tuple[int, int]:
    (e,) = [e for e in c.stats()["engines"] if e["engine"] == c.engine_id]
    return e["live_blocks"], e["pins"]


def _until(cond, what: str, timeout_s: float = 20.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def _saved_to_nvme(ws, c) -> None:
    ws.save([Transfer("w", list(range(1, 9)), HS[:8])])  # more than staging holds: the oldest go down
    _until(lambda: (ws.flush(), not ws.queue)[1], "the saves written")
    _until(lambda: bool(np.all(c.lookup(block_keys(HS[:2]))[1] == 2)), "the oldest blocks on NVMe")


def test_a_refused_seal_leaves_no_staging_blocks_behind(tmp_path):
    geo, d, c = _rig(tmp_path)
    try:
        ws = WorkerSide(c, geo, timeout_s=10.0)
        real = c._call

        def refuse_seal(op, args=None, **kw):  # the fault: the daemon refuses this one seal
            if op == "seal":
                raise RequestRejected("invalid", "refused")
            return real(op, args, **kw)

        c._call = refuse_seal
        ws.save([Transfer("a", [1, 2], HS[:2])])
        c._call = real
        assert ws.stats["save_dropped_blocks"] == 2
        assert _held(c) == (0, 0)  # they stayed pinned and referenced until the engine left
        ws.save([Transfer("b", [3], HS[2:3])])
        assert ws.stats["saved_blocks"] == 1 and _held(c) == (0, 0) and c.check()["ok"]
    finally:
        c.close()
        d.stop()


def test_a_load_is_never_offered_larger_than_staging_nor_again_past_a_failure(tmp_path):
    geo, d, c = _rig(tmp_path)
    try:
        ws, sched = WorkerSide(c, geo, timeout_s=10.0), SchedulerSide(c, BS)
        _saved_to_nvme(ws, c)
        req = _request("r", HS[:7], 8 * BS)
        tokens, _ = sched.matched(req, 0)
        assert tokens == 4 * BS  # 4 staging slots: an acquire of 7 was refused as "can never fit", every time
        sched.after_alloc(req, list(range(8, 16)), tokens)
        sched.load_failed({10})  # its third block failed: vLLM computes from there
        assert sched.matched(req, 0)[0] == 2 * BS  # it had offered the same load again, for ever
        sched.load_failed({8})
        assert sched.matched(req, 0)[0] == 0
    finally:
        c.close()
        d.stop()


def test_async_loads_of_a_reclaimed_session_touch_nothing_of_the_next(tmp_path):
    """A load pending when the daemon reclaimed the engine freed its old ids in the new session
    (another request's refs there) and could report a copy from slots it no longer held."""
    geo, d, c = _rig(tmp_path, "server.heartbeat_timeout_s=1.0", 'tiers.io_backend="faulty"',
                     env={"KVTIER_FAULTS": "delay_s=0.1"}, heartbeat_s=None)  # a silent engine
    try:
        ws, loads = WorkerSide(c, geo, timeout_s=10.0), AsyncLoads(c, geo, timeout_s=10.0)
        _saved_to_nvme(ws, c)
        loads.start([Transfer("A", [10, 11], HS[:2])])
        assert "A" in loads.pending
        time.sleep(2.5)  # silent past the heartbeat timeout: the daemon reclaims the engine
        ws.save([Transfer("x", [1], HS[8:9])])  # its next op learns it
        assert c.reclaimed
        ws.start([])  # the next step reattaches: a new session
        ws.finish_load()
        assert not c.reclaimed and _held(c) == (0, 0)
        ws.save([Transfer("y", list(range(1, 9)), HS[8:16])])
        _until(lambda: (ws.flush(), not ws.queue)[1], "the second saves written")
        loads.start([Transfer("B", [12, 13, 14], HS[:3])])  # the same prefix in the new session
        finished: set[str] = set()
        errors: set[int] = set()

        def both() -> bool:
            loads.poll()
            done, errs = loads.take()
            finished.update(done)
            errors.update(errs)
            return finished == {"A", "B"}

        _until(both, "both loads finished")
        assert {10, 11} <= errors and not errors & {12, 13, 14}  # A failed; B loaded
        assert _held(c) == (0, 0) and c.check()["ok"]
    finally:
        c.close()
        d.stop()

