"""A daemon that goes away or restarts never stops vLLM: the connector's hooks answer "compute
it" meanwhile, and both halves register again on their own once a daemon is back."""

from __future__ import annotations

import hashlib
import time
from types import SimpleNamespace

import torch

from kvtier.bench.spawn import DaemonProcess
from kvtier.connectors.vllm_scheduler import SchedulerSide, Transfer
from kvtier.connectors.vllm_worker import Geometry, WorkerSide

from .test_worker import _load as _step  # one vLLM step: start, every layer, finish

NB, BS, H, D, L = 16, 8, 2, 4, 3
HS = [hashlib.sha256(f"block-{i}".encode()).digest() for i in range(4)]
SIZES = (f"tiers.hbm_bytes={8 * 4096 * 2}", f"tiers.dram_bytes={4 * 4096 * 2}", f"tiers.nvme_bytes={32 * 4096 * 3}")


def _request(rid: str, blocks: int = 3) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, block_hashes=HS[:blocks], num_tokens=blocks * BS + 1)


def test_the_connector_computes_while_the_daemon_is_away_and_takes_it_up_again(tmp_path):
    torch.manual_seed(0)
    kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, NB, BS, H, D) for i in range(L)}
    geo = Geometry(kv, NB)
    d = DaemonProcess(tmp_path, *SIZES)
    wc = d.client(timeout_s=2.0)
    wc.register(block_bytes=geo.block_bytes, block_tokens=BS, layout={"layers": L}, namespace="m")
    sc = d.client(timeout_s=2.0)
    sc.register(block_bytes=geo.block_bytes, block_tokens=BS, layout={"layers": L}, namespace="m", refs_only=True)
    ws, sched = WorkerSide(wc, geo, timeout_s=2.0), SchedulerSide([sc], BS)
    try:
        ws.save([Transfer("a", [1, 2], HS[:2])])
        assert sched.matched(_request("r1"), 0) == (2 * BS, False)
        assert d.stop() == 0
        # away: no hook raises into vLLM; nothing matches, a load is reported for recomputation
        assert sched.matched(_request("r2"), 0) == (0, False)
        assert _step(ws, kv, [Transfer("r1", [5, 6], HS[:2])]) == {5, 6}
        ws.save([Transfer("b", [3], HS[2:3])])
        d = DaemonProcess(tmp_path, *SIZES)  # a new daemon in the same runtime dir: it knows no engine
        assert sched.matched(_request("r3"), 0) == (0, False)  # learns it was reclaimed
        assert _step(ws, kv, [Transfer("r3", [5], HS[:1])]) == {5}
        ws.save([Transfer("c", [1, 2], HS[:2])])  # reclaimed: dropped, not an assertion in vLLM's hook
        # the next steps register again (at most once a second) and work as before
        for _ in range(40):
            sched.matched(_request("r4"), 0)
            _step(ws, kv, [])
            if not wc.reclaimed and not sc.reclaimed:
                break
            time.sleep(0.1)
        assert not wc.reclaimed and not sc.reclaimed
        while ws.step <= ws.tainted_until:  # the failed loads' steps are behind vLLM
            _step(ws, kv, [])
        ws.save([Transfer("d", [1, 2], HS[:2])])
        assert sched.matched(_request("r5"), 0) == (2 * BS, False)
        for t in kv.values():
            t[:, 8:10] = 0
        assert _step(ws, kv, [Transfer("r5", [8, 9], HS[:2])]) == set()
        assert all(torch.equal(t[:, 8:10], t[:, 1:3]) for t in kv.values())
    finally:
        wc.close()
        sc.close()
        d.stop()
