"""The real daemon process over real sockets: clients, fuzzing, reclamation, events, metrics."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvtier.bench.spawn import DaemonProcess
from kvtier.client.tier_client import DaemonUnavailable, RequestRejected, TierClient
from kvtier.daemon.events import decode_batch
from kvtier.protocol import wire as P
from kvtier.tiers.copy_tuning import runnable_loops

WORKER = str(Path(__file__).parent / "client_worker.py")


def wait_for(pred, timeout=10.0, interval=0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def test_socket_files_are_private(daemon):
    rt = daemon.runtime_dir
    assert stat.S_IMODE(os.stat(rt).st_mode) == 0o700
    for name in ("rpc.sock", "telemetry.sock", "events.sock"):
        assert stat.S_IMODE(os.stat(rt / name).st_mode) == 0o600


def test_several_client_processes_keep_their_bytes(daemon):
    procs = [subprocess.Popen([sys.executable, WORKER, str(daemon.runtime_dir), str(i), "work"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(1, 4)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    with daemon.client(heartbeat_s=None) as c:
        c.check()
        s = c.stats()
    assert s["paths"]["hbm->dram"]["moves"] > 0  # pressure really demoted blocks
    assert s["service"]["hits_dram"] + s["service"]["hits_nvme"] > 0  # ... and brought them back
    assert s["blocks"]["live"] == 0 and s["blocks"]["pinned"] == 0  # unregister freed everything


def test_shared_prefix_across_engines(daemon):
    a, b = daemon.client(engine_id="a", heartbeat_s=None), daemon.client(engine_id="b", heartbeat_s=None)
    a.register(block_bytes=4096)
    b.register(block_bytes=4096)
    blk, _ = a.alloc(1, seq=1)
    _, slots = a.acquire(blocks=blk)
    a.slot_view(slots[0]).numpy()[:] = 77
    a.release(blocks=blk)
    canon = a.seal(blk, [0xABC])
    got = b.ref([0xABC, 0xDEF], seq=9)
    assert got.tolist() == [canon[0], -1]
    a.free(blocks=canon)  # a leaves; b still holds the block
    _, slots = b.acquire(seqs=[9])
    assert (b.slot_view(slots[0]).numpy() == 77).all()
    b.release(seqs=[9])
    b.check()
    a.close()
    b.close()


def test_block_size_conflict_is_rejected(daemon):
    with daemon.client(engine_id="a", heartbeat_s=None) as a:
        a.register(block_bytes=4096)
        with daemon.client(engine_id="b", heartbeat_s=None) as b:
            with pytest.raises(RequestRejected) as e:
                b.register(block_bytes=8192)
            assert e.value.code == P.CONFLICT


def _fuzz_frames(rng):
    good = {"v": 1, "id": 1, "op": "alloc", "engine": "fz", "args": {"n": 1}}
    yield b""
    yield b"\xc1"  # never-used msgpack byte
    yield msgpack.packb([1, 2, 3])
    yield msgpack.packb({"v": 2, "id": 1, "op": "ping"})
    yield msgpack.packb({**good, "engine": "nobody"})
    yield msgpack.packb({**good, "op": "launch_missiles"})
    yield msgpack.packb({**good, "args": {"n": "many"}})
    yield msgpack.packb({**good, "args": {"n": 10**12}})
    yield msgpack.packb({**good, "args": {"n": -1}})
    yield msgpack.packb({**good, "args": {}})
    yield msgpack.packb({**good, "args": {"n": 1, "extra": 1}})
    yield msgpack.packb({"v": 1, "id": 2, "op": "acquire", "engine": "fz", "args": {"blocks": b"\x01\x02\x03"}})
    yield msgpack.packb({"v": 1, "id": 2, "op": "acquire", "engine": "fz", "args": {"blocks": [10**9]}})
    yield msgpack.packb({"v": 1, "id": 2, "op": "acquire", "engine": "fz", "args": {"keys": [2**64 - 1]}})
    yield msgpack.packb({"v": 1, "id": 3, "op": "seal", "engine": "fz", "args": {"blocks": [0], "keys": [1, 2]}})
    yield msgpack.packb({"v": 1, "id": 3, "op": "free", "engine": "fz", "args": {"blocks": [0, 0]}})
    yield msgpack.packb({"v": 1, "id": 3, "op": "release", "engine": "fz", "args": {"blocks": [0]}})
    yield msgpack.packb({"v": 1, "id": 3, "op": "register", "engine": "", "args": {"pid": 1, "block_bytes": 4096}})
    yield msgpack.packb({"v": 1, "id": 4, "op": "register", "engine": "x",
                         "args": {"pid": 1, "block_bytes": 4096, "hbm_kind": "shm", "hbm_name": "no-such", "hbm_slots": 4}})
    yield msgpack.packb({"v": 1, "id": 5, "op": "acquire", "engine": "fz", "args": {"blocks": b"\x00" * 8 * 70000}})
    for _ in range(2000):
        n = int(rng.integers(1, 64))
        yield rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()
    for _ in range(1000):  # structurally plausible maps with random values
        yield msgpack.packb({"v": 1, "id": int(rng.integers(0, 100)), "op": str(rng.choice(list(P.ARGS))),
                             "engine": "fz", "args": {str(rng.choice(["n", "blocks", "keys", "seqs", "ticket"])):
                                                      [int(x) for x in rng.integers(-5, 5, size=3)]}})


def test_fuzzed_rpc_gets_error_replies_and_changes_nothing(daemon):
    c = daemon.client(engine_id="fz", heartbeat_s=None)
    c.register(block_bytes=4096)
    blocks, _ = c.alloc(2, seq=1)
    before = c.stats()["blocks"]
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(daemon.info["rpc"])
    rng = np.random.default_rng(0)
    n = codes = 0
    for frame in _fuzz_frames(rng):
        s.send_multipart([b"", frame])
        assert s.poll(5000), "daemon stopped answering"
        reply = msgpack.unpackb(s.recv_multipart()[-1], raw=False)
        n += 1
        if not reply["ok"]:
            codes += 1
            assert reply["error"]["code"] in {P.BAD_FRAME, P.BAD_VERSION, P.BAD_REQUEST, P.UNKNOWN_OP,
                                              P.UNKNOWN_ENGINE, P.TOO_LARGE, P.INVALID, P.NO_SPACE, P.TIMEOUT, P.CONFLICT}
    s.close(0)
    assert n > 3000 and codes > 2900
    assert c.ping()["pong"]
    c.check()
    # the fuzz may alloc/free through "fz" (it is a registered engine), never corrupt: recount ours
    c.release  # noqa: B018 (client still usable)
    after = c.stats()["blocks"]
    assert after["max"] == before["max"]
    c.close()


def test_dead_client_is_reclaimed(daemon):
    p = subprocess.Popen([sys.executable, WORKER, str(daemon.runtime_dir), "9", "hold"], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    with daemon.client(heartbeat_s=None) as c:
        c.register(block_bytes=4096)
        assert c.stats()["blocks"]["pinned"] == 3
        p.send_signal(signal.SIGKILL)
        p.wait()
        wait_for(lambda: c.stats()["blocks"]["pinned"] == 0 and c.stats()["blocks"]["live"] == 0)
        assert [e["engine"] for e in c.stats()["engines"]] == [c.engine_id]
        c.check()


def test_silent_engine_times_out(daemon):
    quiet = daemon.client(engine_id="quiet", heartbeat_s=None)
    quiet.register(block_bytes=4096)
    quiet.alloc(2, seq=1)
    with daemon.client(engine_id="watch", heartbeat_s=0.2) as w:
        w.register(block_bytes=4096)
        wait_for(lambda: "quiet" not in [e["engine"] for e in w.stats()["engines"]], timeout=10)
        assert w.stats()["blocks"]["live"] == 0
    with pytest.raises(RequestRejected) as e:
        quiet.alloc(1, seq=2)
    assert e.value.code == P.UNKNOWN_ENGINE
    quiet.close(unregister=False)


def test_events_in_vllm_shape(daemon):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(daemon.info["events"])
    time.sleep(0.2)  # slow joiner
    with daemon.client(heartbeat_s=None) as c:
        c.register(block_bytes=4096, block_tokens=16)
        blk, _ = c.alloc(1, seq=1)
        c.seal(blk, [42])
        c.free(blocks=blk)
        c._call("clear")
        events = []
        end = time.monotonic() + 5
        payloads = []
        while time.monotonic() < end and not any(e["type"] == "AllBlocksCleared" for e in events):
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                ts, evs, rank = decode_batch(payload)
                assert isinstance(ts, float) and len(seq) == 8
                events.extend(evs)
                payloads.append(payload)
    sub.close(0)
    assert {"type": "BlockStored", "block_hashes": [42], "parent_block_hash": None, "token_ids": [],
            "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None} in events
    assert events[-1] == {"type": "AllBlocksCleared"}
    try:  # vLLM's own structs decode our stream, where vLLM is installed
        import msgspec
        from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
    except ImportError:
        return
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    decoded = [e for p in payloads for e in dec.decode(p).events]
    stored = [e for e in decoded if isinstance(e, BlockStored)]
    assert stored[0].block_hashes == [42] and stored[0].block_size == 16 and stored[0].medium == "GPU"
    assert isinstance(decoded[-1], AllBlocksCleared)


def test_telemetry_and_metrics(daemon):
    with daemon.client(heartbeat_s=None) as c:
        c.register(block_bytes=4096)
        blocks, _ = c.alloc(8, seq=1)
        for _ in range(50):
            c.report_attention(blocks, np.linspace(1, 2, 8))
        wait_for(lambda: c.stats()["service"].get("telemetry_block_updates", 0) == 400)
        stats = c.stats()
        port = stats["metrics_port"]
        time.sleep(1.2)  # the snapshot is published once a second
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    cap = {s.labels["tier"]: s.value for s in fams["kvtier_tier_capacity_bytes"].samples}
    assert cap == {"hbm": 65536, "dram": 65536, "nvme": 262144}
    assert fams["kvtier_telemetry_block_updates"].samples[0].value == 400
    assert "kvtier_acquire_stall_seconds" in fams
    assert stats["io"]["backend"] == "posix"
    # a 64 KiB DRAM pool is too small to time copies on: the import-time loop, and why
    assert stats["io"]["copy_loop"] in [*runnable_loops(), "numpy"] and stats["io"]["copy_loop_how"].startswith(
        "default: the DRAM pool (0 MiB) is too small")
    assert fams["kvtier_nvme_direct_io"].samples[0].value == float(stats["io"]["nvme_direct_io"])
    dash = json.loads((Path(__file__).parents[2] / "daemon" / "grafana" / "kvtier.json").read_text())
    import re
    used = set(re.findall(r"kvtier_[a-z_]+", json.dumps(dash)))
    bases = {re.sub(r"_(bucket|total)$", "", n) for n in used}
    bases -= {"kvtier_predictor_ece", "kvtier_predictor_brier",  # exported once predictions have resolved
              "kvtier_predictor_ece_raw"}
    bases -= {n for n in bases if n.startswith("kvtier_remote_")}  # only with [tiers.remote] (test_metrics has them)
    assert bases <= set(fams), bases - set(fams)


def test_reload_valid_and_invalid(tmp_path):
    cfg = tmp_path / "k.toml"
    cfg.write_text("[scoring]\nema = 0.3\n")
    d = DaemonProcess(tmp_path, "tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=0",
                      config=str(cfg))
    try:
        with d.client(heartbeat_s=None) as c:
            cfg.write_text("[scoring]\nema = 0.6\n")
            assert c.reload()["changed"] == ["scoring"]
            assert c.stats()["config_hot"]["scoring"]["ema"] == 0.6
            cfg.write_text("[scoring]\nema = 9\n")
            with pytest.raises(RequestRejected, match="scoring.ema"):
                c.reload()
            assert c.stats()["config_hot"]["scoring"]["ema"] == 0.6  # running config kept
            cfg.write_text("[scoring]\nema = 0.1\n")
            d.signal(signal.SIGHUP)
            wait_for(lambda: c.stats()["config_hot"]["scoring"]["ema"] == 0.1)
            # once a node runs, the policy keys its policies were built with wait for a restart
            c.register(block_bytes=4096)
            cfg.write_text("[scoring]\nema = 0.1\n[policy]\nrefresh_every = 500\nprior_strength = 3.0\n")
            r = c.reload()
            assert r["restart"] == ["policy.refresh_every"] and r["keys"] == ["policy.prior_strength"]
            hot = c.stats()["config_hot"]["policy"]
            assert hot["refresh_every"] == 2000 and hot["prior_strength"] == 3.0  # the running value kept
    finally:
        assert d.stop() == 0


def test_graceful_stop_removes_runtime_files(tmp_path):
    d = DaemonProcess(tmp_path, "tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=262144")
    assert d.stop() == 0
    assert not (d.runtime_dir / "rpc.sock").exists() and not (d.runtime_dir / "daemon.json").exists()
    with pytest.raises(DaemonUnavailable):
        TierClient(runtime_dir=str(d.runtime_dir))


def test_async_acquire_reports_layers_as_they_land(tmp_path):
    layers, part = 8, 128 << 10
    bb = layers * part
    d = DaemonProcess(tmp_path, f"tiers.hbm_bytes={8 * bb}", f"tiers.dram_bytes={32 * bb}", "tiers.nvme_bytes=0")
    try:
        c = d.client(engine_id="layered", heartbeat_s=None)
        c.register(block_bytes=bb, layout={"layers": layers})

        def expect(b: int, layer: int) -> int:
            return (b * layers + layer) % 251

        first, slots = c.alloc(8, seq=1, pin=True)
        for b, s in zip(first.tolist(), slots.tolist()):
            view = c.slot_view(s).numpy()
            for layer in range(layers):
                view[layer * part:(layer + 1) * part] = expect(b, layer)
        c.seal(first, np.arange(1, 9))  # sealed while pinned: an unpinned open block may already be moving
        c.release(blocks=first)
        second, _ = c.alloc(8, seq=2, pin=True)  # HBM is full of pinned blocks: the first 8 went to DRAM
        c.release(blocks=second)
        h = c.acquire_async(blocks=first)
        seen = np.zeros(8, dtype=np.int64)
        while not h.done:
            ready, where = h.layers_ready()
            assert np.all(ready >= seen) and np.all(ready <= layers)  # monotonic
            seen = ready
            for i in np.flatnonzero(ready).tolist():
                view = c.slot_view(where[i]).numpy()
                for layer in range(int(ready[i])):  # every landed layer is already exact
                    assert view[layer * part] == expect(int(first[i]), layer)
        blocks, slots = h.wait(timeout_s=30)
        for b, s in zip(blocks.tolist(), slots.tolist()):
            view = c.slot_view(s).numpy()
            assert all((view[layer * part:(layer + 1) * part] == expect(b, layer)).all() for layer in range(layers))
        assert c.stats()["paths"]["dram->hbm"]["moves"] >= 8
        c.release(blocks=blocks)
        c.check()
        c.close()
    finally:
        assert d.stop() == 0


def test_alloc_waits_for_demotions_instead_of_bouncing(tmp_path):
    d = DaemonProcess(tmp_path, "tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=0",
                      "tiers.high_watermark=1.0", "tiers.low_watermark=1.0")  # no background demotion
    try:
        with d.client(engine_id="full", heartbeat_s=None) as c:
            c.register(block_bytes=4096)
            first, _ = c.alloc(16, seq=1, pin=True)  # HBM is now full
            c.seal(first, np.arange(1, 17))
            c.release(blocks=first)
            more, _ = c.alloc(4, seq=2, pin=True)  # needs write-backs first: the daemon waits, then answers
            s = c.stats()
            assert more.size == 4 and s["service"].get("rpc_errors", 0) == 0
            assert s["paths"]["hbm->dram"]["moves"] >= 4
            c.release(blocks=more)
            with pytest.raises(RequestRejected) as e:  # more than HBM holds: a clear no
                c.alloc(17, seq=3)
            assert e.value.code == P.NO_SPACE
            c.check()
    finally:
        assert d.stop() == 0


def test_restart_serves_what_a_clean_stop_left_on_nvme(tmp_path):
    """A clean stop leaves a slot index; the next daemon starts from it (no scan) and
    serves the cached blocks found on NVMe, by key, with their bytes."""
    from kvtier.tiers.slot_index import INDEX_FILE

    tiers = ("tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=262144",
             'tiers.recovery_verify="header"')
    data = {i: ((np.arange(4096) * 13 + i * 7) % 251).astype(np.uint8) for i in range(40)}
    keys = (np.arange(1, 41, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).astype(np.int64)
    d = DaemonProcess(tmp_path, *tiers)
    try:
        with d.client(engine_id="before", heartbeat_s=None) as c:
            c.register(block_bytes=4096)
            for i in range(40):  # more than HBM and DRAM hold: the oldest go down to NVMe
                blocks, slots = c.alloc(1, seq=i, pin=True)
                c.slot_view(int(slots[0])).numpy()[:] = data[i]
                canon = c.seal(blocks, keys[i: i + 1], seq=i)
                c.release(blocks=canon)
                c.free(blocks=canon)
            on_nvme = wait_for(lambda: next(r["used"] for r in c.stats()["tiers"] if r["tier"] == "nvme"))
    finally:
        assert d.stop() == 0, d.read_log()
    assert (tmp_path / "nvme" / INDEX_FILE).exists()
    d = DaemonProcess(tmp_path, *tiers)
    try:
        with d.client(engine_id="after", heartbeat_s=None) as c:
            c.register(block_bytes=4096)
            io = c.stats()["io"]
            assert io["recovered_from"] == "index" and io["recovered_blocks"] >= on_nvme
            got = c.ref(keys)
            found = np.flatnonzero(got >= 0)
            assert found.size == io["recovered_blocks"]
            blocks, slots = c.acquire(blocks=got[found], timeout_s=20)
            for i, b, s in zip(found.tolist(), blocks.tolist(), slots.tolist()):
                assert b == got[i] and np.array_equal(c.slot_view(s).numpy(), data[i])
            c.release(blocks=blocks)
            c.check()
        assert not (tmp_path / "nvme" / INDEX_FILE).exists()  # taken at start: a crash now means a scan
    finally:
        assert d.stop() == 0, d.read_log()
