"""CUDA paths: device HBM pool, mover streams, CUDA IPC registration (GPU machines only)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_hbm_round_trip_through_every_tier(tmp_path):
    from kvtier.tiers.manager import TierManager

    m = TierManager(8192, 4, 4, 8, nvme_dir=str(tmp_path), hbm_device="cuda")
    try:
        assert m.hbm.is_cuda
        blocks = m.alloc(3)
        data = [np.random.default_rng(i).integers(0, 256, 8192, dtype=np.uint8) for i in range(3)]
        for b, d in zip(blocks, data):
            m.write(int(b), d)
        keys = [m.seal(int(b), 100 + i) for i, b in enumerate(blocks)]
        m.demote(keys, "hbm", "nvme")  # sealed, so straight from device memory where kvikio runs
        m.wait(30)
        assert not m.last_errors, m.last_errors
        m.promote(keys, "hbm")
        m.wait(30)
        assert not m.last_errors, m.last_errors
        for b, d in zip(keys, data):
            assert m.read(b) == d.tobytes()
        m.check_invariants()
    finally:
        m.close()


def test_cuda_copies_runs_and_scattered_rows(tmp_path):
    """Both GPU copy shapes: consecutive slots as direct DMA runs, scattered
    slots (more runs than MAX_DIRECT_RUNS) as gather + transfer + scatter."""
    from kvtier.tiers.manager import TierManager
    from kvtier.tiers.mover import MAX_DIRECT_RUNS

    n = 4 * MAX_DIRECT_RUNS
    m = TierManager(4096, n, n, 0, hbm_device="cuda")
    try:
        blocks = m.alloc(n)
        data = [np.random.default_rng(50 + i).integers(0, 256, 4096, dtype=np.uint8) for i in range(n)]
        for b, d in zip(blocks.tolist(), data):
            m.write(b, d)
            m.seal(b, 500 + b)
        run, scattered = blocks[:MAX_DIRECT_RUNS], blocks[MAX_DIRECT_RUNS::2]  # 1 run; 24 runs of one slot
        for group in (run, scattered):
            m.demote(group, "hbm", "dram"); m.wait(30)
            m.promote(group, "hbm"); m.wait(30)
        assert not m.last_errors
        for b, d in zip(blocks.tolist(), data):
            assert m.read(b) == d.tobytes()
        m.check_invariants()
    finally:
        m.close()


def test_cuda_ipc_export_import_in_another_process():
    from kvtier.protocol.cuda_ipc import export_handle

    t = torch.arange(4096, dtype=torch.uint8, device="cuda")
    blob = export_handle(t)
    code = ("import sys, torch; from kvtier.protocol.cuda_ipc import import_handle; "
            "x = import_handle(sys.stdin.buffer.read()); print(int(x.sum()), x.numel())")
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode().split() == [str(int(t.sum())), "4096"]


def test_engine_maps_a_daemon_allocated_cuda_pool(tmp_path):
    """No region from the engine: the daemon allocates HBM on the GPU and the
    engine maps it over CUDA IPC; bytes survive demotion under pressure and
    promotion back (tests/daemon/client_worker.py checks every one)."""
    from pathlib import Path

    from kvtier.bench.spawn import DaemonProcess

    worker = Path(__file__).parents[1] / "daemon" / "client_worker.py"
    d = DaemonProcess(tmp_path, "tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=262144",
                      "server.heartbeat_timeout_s=5.0")
    try:
        p = subprocess.run([sys.executable, str(worker), str(d.runtime_dir), "1", "work"],
                           capture_output=True, text=True, timeout=180)
        assert p.returncode == 0 and "ok" in p.stdout, p.stdout + p.stderr
        with d.client(heartbeat_s=None) as c:
            c.register(block_bytes=4096)
            assert c.info["hbm_kind"] == "cuda" and c.hbm is not None and c.hbm.is_cuda
            assert tuple(c.hbm.shape) == (c.info["hbm_slots"], c.info["slot_stride"])
            c.check()
            s = c.stats()
        assert s["paths"]["hbm->dram"]["moves"] > 0
        assert s["service"]["hits_dram"] + s["service"]["hits_nvme"] > 0
    finally:
        assert d.stop() == 0, d.read_log()
