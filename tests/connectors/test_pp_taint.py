"""Pipeline stages: a later stage drops the saves that a failed load on an earlier stage
tainted, though its own load succeeded. Two real worker processes, stage 0 and stage 1 of
one engine, each in its own namespace on one real daemon, sharing a real board in POSIX
shared memory; the test plays vLLM, running each scheduler step on stage 0 before stage 1
(stage 1 computes from stage 0's activations)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.bench.spawn import DaemonProcess
from kvtier.connectors import pp_taint
from kvtier.connectors.pp_taint import StageBoard, StageTaint, board_name

STAGE = r"""
import hashlib, json, sys
import torch
from kvtier.client.tier_client import TierClient
from kvtier.connectors.keys import block_key
from kvtier.connectors import pp_taint
from kvtier.connectors.pp_taint import StageTaint
from kvtier.connectors.vllm_scheduler import Transfer
from kvtier.connectors.vllm_worker import Geometry, WorkerSide

# board: a segment's name; "-": no board at all (as before boards); "missing": a name no segment has
stage, runtime, board, fail_at = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
pp_taint.ATTACH_WAIT_S = 0.1
torch.manual_seed(stage)
kv = {f"model.layers.{i}.self_attn.attn": torch.randn(2, 16, 8, 2, 4) for i in range(2)}
geo = Geometry(kv, 16)
c = TierClient(runtime_dir=runtime, engine_id=f"worker-pp{stage}", heartbeat_s=None)
c.register(block_bytes=geo.block_bytes, block_tokens=8, layout={"layers": 2}, namespace=f"m:pp{stage}/2:tp0/1")
HS = [hashlib.sha256(f"block-{i}".encode()).digest() for i in range(8)]
taint = None if board == "-" else StageTaint(stage, 0, 2, 1)
ws = WorkerSide(c, geo, timeout_s=10.0, stages=taint)
ws.step = 5 * stage  # the workers' own step counters need not agree with each other or the scheduler's
for line in sys.stdin:  # one scheduler step per line, in the order vLLM's activations impose
    step = int(line)
    if taint is not None:
        taint.bind("kvtier_pp_no_such_board" if board == "missing" else board)
    if step == 1:
        loads = []
    elif step == fail_at and stage == 0:
        loads = [Transfer("b", [2], HS[7:8])]  # never saved: this stage's load fails
    else:
        loads = [Transfer("b", [2], HS[:1])]   # held: loads fine
    ws.start(loads, sched_step=100 + step)
    for name in kv:
        ws.wait_layer(name)
    ws.finish_load()
    ws.save([Transfer("c", [3 + step], HS[step - 1:step])])  # step k computes block k - 1
    ws.take_errors()
    print(json.dumps({"step": step}), flush=True)
got, _ = c.lookup([block_key(h) for h in HS[:6]])
print(json.dumps({"held": (got >= 0).tolist(), "dropped": ws.stats["save_dropped_blocks"],
                  "upstream": ws.stats["upstream_tainted_steps"], "failed": ws.stats["failed_blocks"]}), flush=True)
if taint is not None:
    taint.close()
c.close()
"""


def _run_stages(tmp_path, board: str, fail_at: int, steps: int = 6) -> list[dict]:
    """Each step on stage 0, then on stage 1; the stages' final reports."""
    d = DaemonProcess(tmp_path, f"tiers.hbm_bytes={64 * 4096}", f"tiers.dram_bytes={16 * 4096}",
                      f"tiers.nvme_bytes={32 * 4096 * 3}")
    procs = []
    try:
        procs = [subprocess.Popen([sys.executable, "-c", STAGE, str(s), str(d.runtime_dir), board, str(fail_at)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for s in range(2)]
        for step in range(1, steps + 1):
            for p in procs:
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write(f"{step}\n")
                p.stdin.flush()
                line = p.stdout.readline()
                assert line, p.stderr.read() if p.stderr else ""
                assert json.loads(line) == {"step": step}
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        d.stop()


def test_a_later_stage_drops_the_steps_an_earlier_stages_failed_load_tainted(tmp_path):
    board = StageBoard(board_name(), 2, 1, create=True)  # as the scheduler makes it
    try:
        s0, s1 = _run_stages(tmp_path, board.name, fail_at=3)
    finally:
        board.close()
    # stage 0's load of step 3 failed: its own saves of steps 3 and 4 (blocks 2, 3) are dropped
    assert s0["failed"] == 1 and s0["held"] == [True, True, False, False, True, True]
    # stage 1 loaded fine, but computed steps 3 and 4 from stage 0's wrong activations: dropped too
    assert s1["failed"] == 0 and s1["held"] == [True, True, False, False, True, True]
    assert s1["upstream"] == 2 and s1["dropped"] == 2


def test_without_a_board_the_later_stage_kept_the_tainted_steps(tmp_path):
    """The defect the board closes: with no way to hear of stage 0's failure, stage 1 sealed
    the KV it computed from stage 0's wrong activations."""
    s0, s1 = _run_stages(tmp_path, "-", fail_at=3)
    assert s0["held"] == [True, True, False, False, True, True]
    assert s1["held"] == [True] * 6 and s1["dropped"] == 0


def test_a_later_stage_that_cannot_map_the_board_saves_nothing(tmp_path):
    s0, s1 = _run_stages(tmp_path, "missing", fail_at=0)
    assert s0["held"] == [True] * 6  # the first stage has no upstream: it saves as ever
    assert s1["held"] == [False] * 6 and s1["upstream"] == 6 and s1["dropped"] == 6


def test_the_board_reads_only_earlier_stages_and_keeps_the_latest_window(monkeypatch):
    monkeypatch.setattr(pp_taint, "ATTACH_WAIT_S", 0.05)
    board = StageBoard(board_name(), 3, 2, create=True)
    try:
        peer = StageBoard(board.name, 3, 2)  # another process's mapping of the same segment
        assert [board.tainted_until(s) for s in range(3)] == [-1, pp_taint.NO_BOARD, pp_taint.NO_BOARD]
        for s in range(3):
            for r in range(2):
                (peer if s % 2 else board).mark(s, r)
        assert [board.tainted_until(s) for s in range(3)] == [-1, -1, -1]  # everyone here, nothing tainted
        peer.publish(1, 1, 7)
        assert [board.tainted_until(s) for s in range(3)] == [-1, -1, 7]  # stage 1's failure: stage 2 only
        peer.publish(1, 1, 5)  # an older window does not shorten the latest
        board.publish(0, 0, 9)
        assert [board.tainted_until(s) for s in range(3)] == [-1, 9, 9]
        assert board.taint.tolist() == [[10, 0], [0, 8], [0, 0]]
        peer.close()
        again = StageBoard(board.name, 3, 2)
        assert again.taint.tolist() == [[10, 0], [0, 8], [0, 0]]  # a reader's close does not unlink
        again.close()
    finally:
        board.close()
    with pytest.raises(FileNotFoundError):
        StageBoard(board.name, 3, 2)  # the owner's close removed the name


def test_an_earlier_stage_that_never_mapped_the_board_taints_every_step(monkeypatch):
    """Its silence is not "no failure": it could not have written one."""
    board = StageBoard(board_name(), 3, 1, create=True)
    try:
        later = StageTaint(2, 0, 3, 1)
        later.bind(board.name)
        StageTaint(0, 0, 3, 1).bind(board.name)  # stage 0 has it; stage 1 never came
        assert later.upstream_until() == pp_taint.NO_BOARD
        board.mark(1, 0)
        assert later.upstream_until() == -1
        later.close()
    finally:
        board.close()


def test_workers_map_the_board_without_the_resource_tracker(monkeypatch):
    """vLLM's workers share the scheduler process's resource tracker: an attach that
    registered and unregistered the name would delete the scheduler's own entry."""
    from multiprocessing import resource_tracker

    board = StageBoard(board_name(), 2, 1, create=True)

    def refuse(*a, **k):
        raise AssertionError(f"resource tracker called: {a}")

    try:
        monkeypatch.setattr(resource_tracker, "register", refuse)
        monkeypatch.setattr(resource_tracker, "unregister", refuse)
        worker = StageTaint(1, 0, 2, 1)
        worker.bind(board.name)
        assert worker.board is not None and worker.upstream_until() == pp_taint.NO_BOARD  # stage 0 not here yet
        worker.close()
        monkeypatch.undo()
    finally:
        board.close()


def test_a_worker_that_cannot_map_the_board_saves_nothing_after_the_first_stage(monkeypatch):
    monkeypatch.setattr(pp_taint, "ATTACH_WAIT_S", 0.05)
    first, later = StageTaint(0, 0, 2, 1), StageTaint(1, 0, 2, 1)
    for t in (first, later):
        t.bind("kvtier_pp_no_such_board")
        t.bind("kvtier_pp_no_such_board")  # not tried again every step
    assert first.upstream_until() == -1  # the first stage has no upstream
    assert later.upstream_until() >= 2**62  # every step tainted
    later.bind(None)  # the scheduler named none
    assert later.upstream_until() >= 2**62
    board = StageBoard(board_name(), 2, 1, create=True)
    try:
        later.bind(board.name)  # a board after all, and stage 0 on it: the stage saves again
        first.bind(board.name)
        assert later.upstream_until() == -1
        first.publish(4)
        assert later.upstream_until() == 4
        later.close()
        first.close()
    finally:
        board.close()
