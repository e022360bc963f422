"""Tensor-parallel ranks drop the same steps' saves when any rank's load failed: two real
worker processes in a real gloo group (the collective vLLM's TP CPU group runs), one real
daemon, each rank in its own namespace as the connector registers them."""

from __future__ import annotations

import json
import subprocess
import sys

from kvtier.bench.spawn import DaemonProcess

RANK = r"""
import hashlib, json, sys
import torch, torch.distributed as dist
from kvtier.client.tier_client import TierClient
from kvtier.connectors.keys import block_key
from kvtier.connectors.tp_taint import latest_taint
from kvtier.connectors.vllm_scheduler import Transfer
from kvtier.connectors.vllm_worker import Geometry, WorkerSide

rank, store, runtime, cases = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
torch.manual_seed(rank)
kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, 16, 8, 2, 4) for i in range(3)}
geo = Geometry(kv, 16)
c = TierClient(runtime_dir=runtime, engine_id=f"worker-tp{rank}", heartbeat_s=None)
c.register(block_bytes=geo.block_bytes, block_tokens=8, layout={"layers": 3}, namespace=f"m:tp{rank}/2")
agree = latest_taint(dist.group.WORLD)


def run(case, failing, found, spec):
    # spec: speculative decoding's order, vLLM takes a step's errors before its saves
    HS = [hashlib.sha256(f"case-{case}-block-{i}".encode()).digest() for i in range(8)]
    ws = WorkerSide(c, geo, timeout_s=10.0, agree=agree)
    errors = set()

    def step(loads, saves, forward_waits=True):
        ws.start(loads)
        if forward_waits:
            for name in kv:
                ws.wait_layer(name)
        if spec:
            errors.update(ws.take_errors())
        ws.finish_load()  # a layer the forward did not wait for is checked here, after vLLM asked
        ws.save(saves)
        if not spec:
            errors.update(ws.take_errors())

    step([], [Transfer("a", [1], HS[:1])])  # both ranks hold block 0
    if rank != failing:
        load = HS[:1]                       # loads fine
    elif found == "early":
        load = HS[1:2]                      # never saved: refused when the load starts
    else:
        load = [block_key(HS[0])]           # same 64-bit key, another hash: found when the bytes are checked
    step([Transfer("b", [2], load)], [Transfer("c", [3], HS[2:3])], forward_waits=found == "early")
    for i in (3, 4, 5):
        step([], [Transfer("c", [i + 1], HS[i:i + 1])])
    got, _ = c.lookup([block_key(h) for h in HS[2:6]])
    return {"errors": sorted(errors), "held": (got >= 0).tolist(), "dropped": ws.stats["save_dropped_blocks"]}


print(json.dumps({"rank": rank, "cases": [run(k, *case) for k, case in enumerate(cases)]}))
c.close()
dist.destroy_process_group()
"""


def _run_ranks(tmp_path, cases: list[tuple[int, str, bool]]) -> dict[int, list[dict]]:
    """Each case (failing rank or -1, failure found "early" or "late", speculative order) in
    turn, in one gloo group of two worker processes against one daemon."""
    # staging for every block of every case: no save waits behind a demotion (a lookup would miss it)
    d = DaemonProcess(tmp_path, f"tiers.hbm_bytes={128 * 4096}", f"tiers.dram_bytes={16 * 4096}",
                      f"tiers.nvme_bytes={32 * 4096 * 3}")
    try:
        procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(tmp_path / "store"), str(d.runtime_dir),
                                   json.dumps(cases)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        out = {}
        for p in procs:
            stdout, stderr = p.communicate(timeout=180)
            assert p.returncode == 0, stderr[-3000:]
            rec = json.loads(stdout.strip().splitlines()[-1])
            out[rec["rank"]] = rec["cases"]
        return out
    finally:
        d.stop()


FAILING = 1  # rank 0, whose own load succeeds, is the one that used to keep its saves
CASES = [  # (failure found, speculative decoding's order, steps whose saves are dropped)
    ("early", False, 2),  # the failing step and the one vLLM scheduled before it heard
    ("early", True, 2),   # reported in its own step's errors: no later than without speculation
    ("late", True, 3),    # found after vLLM took the step's errors: heard of a step later
]


def test_a_load_failed_on_one_rank_drops_every_rank_s_saves_of_the_tainted_steps(tmp_path):
    ranks = _run_ranks(tmp_path, [(FAILING, found, spec) for found, spec, _ in CASES] + [(-1, "early", False)])
    for k, (found, spec, tainted) in enumerate(CASES):
        assert ranks[FAILING][k]["errors"] == [2], (found, spec)
        assert ranks[1 - FAILING][k]["errors"] == []  # its own load succeeded ...
        for r in (0, 1):  # ... yet it keeps nothing computed in the tainted steps: the failing rank's window
            assert ranks[r][k]["held"] == [False] * tainted + [True] * (4 - tainted), (found, spec, r)
            assert ranks[r][k]["dropped"] == tainted
    for r in (0, 1):  # the last case: with no failure every rank saves every step
        assert ranks[r][-1] == {"errors": [], "held": [True] * 4, "dropped": 0}
