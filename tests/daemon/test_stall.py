"""A stalled disk never stalls the owner loop: RPCs answer, live engines stay, nothing is lost.

Every NVMe I/O takes 1 s (fault injector), the mover has one I/O thread and a
lane queue of one, and engines are judged dead after 0.5 s of silence. Three
promotions from NVMe in a row then wait 1-3 s for the disk. Submitting the
third used to block the owner loop until the disk took the first: heartbeats
went unread meanwhile and were judged stale, so live engines were reclaimed.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvtier.bench.spawn import DaemonProcess
from kvtier.client.tier_client import KvtierError

BB = 4096
N_DISK = 3  # blocks demoted to the slow disk, then promoted back one acquire each


def _payload(tag: int) -> np.ndarray:
    return np.full(BB, (tag * 37 + 11) % 251, dtype=np.uint8)


def test_stalled_disk_keeps_rpcs_answering_and_engines_alive(tmp_path):
    d = DaemonProcess(tmp_path, f"tiers.hbm_bytes={8 * BB}", "tiers.dram_bytes=0", f"tiers.nvme_bytes={16 * BB}",
                      'tiers.io_backend="faulty"', "tiers.mover_workers=1", "tiers.mover_queue_depth=1",
                      "server.heartbeat_timeout_s=0.5", env={"KVTIER_FAULTS": "delay_s=1.0"})
    try:
        with d.client(engine_id="writer", heartbeat_s=0.1) as w, d.client(engine_id="idle", heartbeat_s=0.1) as idle, \
                d.client(engine_id="watcher", heartbeat_s=None, timeout_s=0.6) as watch:
            w.register(block_bytes=BB)
            idle.register(block_bytes=BB)
            blocks, slots = w.alloc(8, seq=1, pin=True)  # HBM full of sealed live blocks
            for tag, s in enumerate(slots.tolist()):
                w.slot_view(s)[:] = torch.from_numpy(_payload(tag))
            keys = np.arange(1000, 1008, dtype=np.uint64)
            sealed = w.seal(blocks, keys, seq=1)
            w.release(blocks=sealed)
            extra, _ = w.alloc(N_DISK, seq=2, pin=True)  # room for these: N_DISK blocks go to the disk
            w.release(blocks=extra)
            w.free(blocks=extra)  # ... and leave their HBM slots free for the promotions back
            assert w.stats()["paths"]["hbm->nvme"]["moves"] == N_DISK
            handles = [w.acquire_async(keys=[k], timeout_s=30) for k in keys.tolist()]  # promotions queue up
            answered, slowest = 0, 0.0
            while not all(h.done or h.poll().all() for h in handles):
                t0 = time.monotonic()
                try:
                    watch.ping()
                except KvtierError as e:
                    raise AssertionError(f"the daemon stopped answering while the disk stalled: {e}") from None
                slowest = max(slowest, time.monotonic() - t0)
                answered += 1
                time.sleep(0.05)
            s = watch.stats()
            assert answered >= 10, answered  # the promotions took seconds: the daemon answered all along
            assert {e["engine"] for e in s["engines"]} >= {"writer", "idle"}
            assert s["service"].get("reclaimed_timeout", 0) == 0
            assert s["paths"]["nvme->hbm"]["moves"] >= N_DISK
            for tag, (k, h) in enumerate(zip(keys.tolist(), handles)):  # nothing lost: every byte as written
                got_blocks, got_slots = h.wait(timeout_s=10)
                assert np.array_equal(w.slot_view(int(got_slots[0])).numpy(), _payload(tag)), f"key {k}"
                w.release(blocks=got_blocks)
            assert w._call("check")["ok"]
    finally:
        assert d.stop() == 0, d.read_log()
