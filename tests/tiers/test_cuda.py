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


def test_layered_promotion_waits_on_events_not_the_stream(tmp_path, monkeypatch):
    """DRAM -> HBM layer by layer: every part queued at once, progress from one event
    per part; the stream is never synchronised per part."""
    from kvtier.tiers.manager import TierManager

    m = TierManager(16384, 8, 8, 0, hbm_device="cuda")
    try:
        blocks = m.alloc(6)
        data = [np.random.default_rng(70 + i).integers(0, 256, 16384, dtype=np.uint8) for i in range(6)]
        for b, d in zip(blocks.tolist(), data):
            m.write(b, d)
            m.seal(b, 700 + b)
        m.demote(blocks, "hbm", "dram"); m.wait(30)
        syncs = []
        monkeypatch.setattr(m.mover, "sync", lambda: syncs.append(1))
        m.promote(blocks, "hbm", chunks=4); m.wait(30)
        assert not m.last_errors and not syncs
        monkeypatch.undo()
        for b, d in zip(blocks.tolist(), data):
            assert m.read(b) == d.tobytes()
        m.check_invariants()
    finally:
        m.close()


def test_nvme_promotion_bounces_through_pinned_buffers(tmp_path, monkeypatch):
    """posix backend, CUDA pool: more blocks than bounce buffers, no per-block host
    allocation, buffers page-locked, bytes exact."""
    from kvtier.tiers import paths
    from kvtier.tiers.manager import TierManager

    m = TierManager(8192, 80, 0, 80, nvme_dir=str(tmp_path), hbm_device="cuda", io_backend="posix")
    try:
        assert m.mover.bounce is not None and m.mover.bounce.pinned and len(m.mover.bounce) < 80
        blocks = m.alloc(80)
        data = [np.random.default_rng(900 + i).integers(0, 256, 8192, dtype=np.uint8) for i in range(80)]
        for b, d in zip(blocks.tolist(), data):
            m.write(b, d)
            m.seal(b, 9000 + b)
        m.demote(blocks, "hbm", "nvme"); m.wait(60)
        monkeypatch.setattr(paths, "aligned_empty", lambda *a: (_ for _ in ()).throw(AssertionError("per-block buffer")))
        m.promote(blocks, "hbm"); m.wait(60)
        assert not m.last_errors, m.last_errors
        monkeypatch.undo()
        for b, d in zip(blocks.tolist(), data):
            assert m.read(b) == d.tobytes()
        m.check_invariants()
    finally:
        m.close()


def test_kvikio_promotion_reads_device_direct(tmp_path, monkeypatch):
    from kvtier.tiers.io_backends import kvikio_status
    from kvtier.tiers.manager import TierManager
    from kvtier.tiers.pools import BounceBuffers

    ok, why = kvikio_status()
    if not ok:
        pytest.skip(why)
    m = TierManager(12288, 8, 0, 8, nvme_dir=str(tmp_path), hbm_device="cuda", io_backend="kvikio")
    try:
        blocks = m.alloc(5)
        data = [np.random.default_rng(300 + i).integers(0, 256, 12000, dtype=np.uint8) for i in range(5)]
        for b, d in zip(blocks.tolist(), data):
            m.write(b, d)
            m.seal(b, 3000 + b, 12000)
        m.demote(blocks, "hbm", "nvme"); m.wait(60)
        monkeypatch.setattr(BounceBuffers, "take", lambda *a: (_ for _ in ()).throw(AssertionError("bounced")))
        m.promote(blocks, "hbm"); m.wait(60)
        assert not m.last_errors, m.last_errors
        for b, d in zip(blocks.tolist(), data):
            assert m.read(b) == d.tobytes()
        m.check_invariants()
    finally:
        m.close()


def test_engine_on_cuda_is_bit_exact_with_hbm_at_25_percent(tmp_path):
    """The transformers engine on the GPU, pools on the GPU: tokens and logits equal
    the untiered run's (torch.equal) while idle sessions spill to DRAM and NVMe;
    generate() keys blocks by their K/V bytes from a device pool."""
    pytest.importorskip("transformers")
    from transformers import DynamicCache

    from kvtier.bench.spawn import DaemonProcess
    from kvtier.bench.workload import build_model
    from kvtier.client.hf_cache import KVLayout, TieredCache

    from ..client.test_engine import step_both

    model = build_model("tiny", seed=0).cuda()
    layout = KVLayout.from_config(model.config, 16)
    sessions, prompt, decode = 6, 100, 12
    per_session = -(-(prompt + decode) // 16)
    hbm = max(round(0.25 * sessions * per_session), per_session + 2)
    d = DaemonProcess(tmp_path, f"tiers.hbm_bytes={layout.block_bytes * hbm}",
                      f"tiers.dram_bytes={layout.block_bytes * 4}", f"tiers.nvme_bytes={layout.block_bytes * 256}")
    try:
        c = d.client(engine_id="cuda-engine")
        c.register(block_bytes=layout.block_bytes, block_tokens=16, layout=layout.describe())
        assert c.hbm is not None and c.hbm.is_cuda
        g = torch.Generator().manual_seed(9)
        runs = []
        for _ in range(sessions):
            ref, tc = DynamicCache(config=model.config), TieredCache(c, layout)
            nxt = step_both(model, torch.randint(0, 512, (1, prompt), generator=g).cuda(), ref, tc)
            tc.deactivate()
            runs.append((ref, tc, nxt))
        for ref, tc, nxt in runs:  # second turn: each idle session comes back from DRAM or NVMe
            for _ in range(decode):
                nxt = step_both(model, nxt, ref, tc)
            tc.deactivate()
        s = c.stats()
        assert s["service"]["hits_dram"] + s["service"]["hits_nvme"] > 0
        ids = torch.randint(0, 512, (2, 19), generator=g).cuda()
        kw = dict(max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
        a = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
        tc = TieredCache(c, layout, batch_size=2)
        b = model.generate(ids, cache=tc, **kw)
        assert torch.equal(a.sequences, b.sequences)
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
        for _, t, _ in runs:
            t.close()
        tc.close()
        c.check()
        c.close()
    finally:
        assert d.stop() == 0, d.read_log()
