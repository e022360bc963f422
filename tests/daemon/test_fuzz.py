"""50,000 fuzzed frames with numeric extremes: the daemon answers every one, never stops, and
what another engine holds (its blocks, their bytes, its pins) is untouched."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import torch
import zmq

from kvtier.bench.spawn import DaemonProcess
from kvtier.protocol import wire as P

FRAMES = 50_000
EXTREMES = [0, 1, -1, 2**31 - 1, 2**31, -(2**31), 2**32, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 2**64 - 1,
            0.5, -0.0, 1e308, -1e308, math.inf, -math.inf, math.nan, True, False, None, "", "x" * 300,
            b"", b"\x00" * 7, b"\xff" * 8, b"\x00" * 16, [], [2**64 - 1], [-1, 2**63], {"a": 1}]
FIELDS = ["n", "blocks", "keys", "seqs", "seq", "ticket", "pin", "wait", "timeout_s", "deadline_s", "nbytes",
          "pid", "pid_ns", "block_bytes", "block_tokens", "hbm_kind", "hbm_name", "hbm_slots", "hbm_handle",
          "layout", "namespace", "token", "mass", "kind"]
EXPECTED = {P.BAD_FRAME, P.BAD_VERSION, P.BAD_REQUEST, P.UNKNOWN_OP, P.UNKNOWN_ENGINE, P.TOO_LARGE, P.INVALID,
            P.NO_SPACE, P.TIMEOUT, P.CONFLICT, P.FORBIDDEN}


def _frames(rng: np.random.Generator):
    ops = sorted(P.ARGS) + ["nope"]
    engines = ["", "fz1", "fz2", "keeper-not", "x" * 300]
    for i in range(FRAMES):
        kind = i % 10
        if kind == 0:  # raw bytes
            yield rng.integers(0, 256, size=int(rng.integers(0, 48)), dtype=np.uint8).tobytes()
            continue
        pick = lambda seq: seq[int(rng.integers(len(seq)))]  # noqa: E731
        args = {pick(FIELDS): pick(EXTREMES) for _ in range(int(rng.integers(0, 4)))}
        msg: dict = {"v": 1, "id": int(rng.integers(0, 2**31)), "op": pick(ops), "engine": pick(engines), "args": args}
        if kind == 1:
            msg["v"] = pick(EXTREMES)
        elif kind == 2:
            msg["id"] = pick(EXTREMES)
        elif kind == 3:
            msg["args"] = pick(EXTREMES)
        elif kind == 4:
            msg["extra"] = 1
        yield msgpack.packb(msg)


def test_fifty_thousand_fuzzed_frames_change_nothing_they_should_not(tmp_path):
    d = DaemonProcess(tmp_path, "tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=262144",
                      "server.heartbeat_timeout_s=30")
    try:
        with d.client(engine_id="keeper", heartbeat_s=None) as keeper:
            keeper.register(block_bytes=4096)
            blocks, slots = keeper.alloc(3, seq=1, pin=True)
            for i, s in enumerate(slots.tolist()):
                keeper.slot_view(s)[:] = torch.full((4096,), 40 + i, dtype=torch.uint8)
            sealed = keeper.seal(blocks, [101, 102, 103], seq=1)
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(d.info["rpc"])
            sent = got = 0
            rng = np.random.default_rng(7)
            pending = 0
            for frame in _frames(rng):
                sock.send_multipart([b"", frame])
                sent += 1
                pending += 1
                if pending == 256:  # a window of requests in flight, then read their replies
                    while pending:
                        assert sock.poll(10_000), f"the daemon stopped answering after {got} replies"
                        reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
                        got += 1
                        pending -= 1
                        if not reply["ok"]:
                            assert reply["error"]["code"] in EXPECTED, reply
            while pending:
                assert sock.poll(10_000)
                sock.recv_multipart()
                got += 1
                pending -= 1
            sock.close(0)
            assert sent == got == FRAMES  # every frame answered
            assert keeper.ping()["pong"] and keeper.check()["ok"]
            s = keeper.stats()
            mine = [e for e in s["engines"] if e["engine"] == "keeper"]
            assert mine and mine[0]["pins"] == 3 and mine[0]["live_blocks"] == 3
            got_blocks, got_slots = keeper.acquire(blocks=sealed)
            for i, b in enumerate(sealed.tolist()):
                slot = int(got_slots[got_blocks.tolist().index(b)])
                assert bool((keeper.slot_view(slot) == 40 + i).all()), f"block {b} changed"
    finally:
        assert d.stop() == 0, d.read_log()
