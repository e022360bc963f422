"""The engine-side client keeps nothing of a session the daemon has ended, and the daemon
is never left holding what the client gave up on."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from kvtier.bench.spawn import DaemonProcess
from kvtier.client.tier_client import EngineReclaimed, KvtierError, RequestRejected, RequestTimeout


def _mine(client) -> dict:
    (me,) = [e for e in client.stats()["engines"] if e["engine"] == client.engine_id]
    return me


def test_a_second_register_starts_afresh_with_no_stale_lease(tmp_path):
    d = DaemonProcess(tmp_path, f"tiers.hbm_bytes={64 * 4096}", "tiers.dram_bytes=65536", "tiers.nvme_bytes=0",
                      "tiers.max_blocks=64")
    a, b = d.client(heartbeat_s=None), d.client(heartbeat_s=None)
    try:
        a.register(block_bytes=4096)
        b.register(block_bytes=4096)
        a.alloc(1)  # the client leases a few more blocks than it hands out
        a.register(block_bytes=4096)  # the daemon takes back everything of the first session
        theirs, _ = b.alloc(60, seq=1)  # another engine gets the freed ids
        mine, _ = a.alloc(1, seq=1)
        assert not set(mine.tolist()) & (set(theirs.tolist()) | set(b._lease))
        assert _mine(a)["live_blocks"] == 1 + len(a._lease)  # what it holds: this session's blocks only
        a.acquire(seqs=[1])
        a.release(seqs=[1])
        a.check()
    finally:
        a.close()
        b.close()
        assert d.stop() == 0


def test_a_blocking_acquire_the_client_gives_up_on_leaves_no_pins(tmp_path):
    d = DaemonProcess(tmp_path, "tiers.hbm_bytes=16384", "tiers.dram_bytes=65536", "tiers.nvme_bytes=0",
                      "server.acquire_timeout_s=60")
    a, b = d.client(timeout_s=1.0), d.client()
    try:
        a.register(block_bytes=4096)
        b.register(block_bytes=4096)
        x, _ = a.alloc(1, seq=1)
        a.seal(x, [42])
        a.free(seqs=[1])  # a cached block of key 42
        b.alloc(4, seq=1, pin=True)  # all of HBM, pinned: key 42's block waits in DRAM
        got = a.ref([42], seq=2)
        with pytest.raises(RequestRejected) as e:  # the daemon was told the client's wait
            a.acquire(blocks=got)
        assert e.value.code == "timeout"
        b.release(seqs=[1])  # room now: nothing finishes the given-up acquire behind the client's back
        a.ping()
        assert _mine(a)["pins"] == 0
        a.free(seqs=[2])
        a.check()
    finally:
        a.close()
        b.close()
        assert d.stop() == 0


def test_a_request_whose_reply_is_lost_ends_the_session_and_a_new_one_holds_nothing_of_it(tmp_path):
    d = DaemonProcess(tmp_path, "tiers.hbm_bytes=16384", "tiers.dram_bytes=65536", "tiers.nvme_bytes=0")
    a = d.client(timeout_s=0.5)
    try:
        a.register(block_bytes=4096)
        x, _ = a.alloc(1, seq=1)
        a.seal(x, [7])
        os.kill(d.proc.pid, signal.SIGSTOP)  # the daemon stalls past the client's timeout
        try:
            with pytest.raises(RequestTimeout):
                a.acquire(seqs=[1])
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)  # ... then carries the acquire out: a pin nobody knows of
        with pytest.raises(EngineReclaimed):  # the client does not go on as if nothing happened
            a.release(seqs=[1])
        deadline = time.monotonic() + 10
        while not a.reattach() and time.monotonic() < deadline:
            time.sleep(0.2)
        me = _mine(a)
        assert me["pins"] == 0 and me["live_blocks"] == len(a._lease)  # the old session's holdings are gone
        a.check()
    finally:
        a.close()
        assert d.stop() == 0


def test_a_lost_reply_to_the_poll_that_completes_an_acquire_ends_the_session(tmp_path):
    """The poll that completes an acquire hands its pins to the session; lost, the engine
    never learns the slots and nothing would ever release them (the next poll answers
    "unknown ticket", a free is refused for the pins). It ends the session as a lost
    acquire does, and the next register takes them back."""
    bb = 4096
    d = DaemonProcess(tmp_path, f"tiers.hbm_bytes={8 * bb}", f"tiers.dram_bytes={32 * bb}", "tiers.nvme_bytes=0")
    c = d.client(engine_id="e", heartbeat_s=None, timeout_s=10.0)
    try:
        c.register(block_bytes=bb)
        first, _ = c.alloc(8, seq=1, pin=True)
        c.seal(first, list(range(1, 9)), seq=1)
        c.release(blocks=first)
        second, _ = c.alloc(8, seq=2, pin=True)  # pushes the first 8 down to DRAM
        c.release(blocks=second)
        c.free(seqs=[2])
        h = c.acquire_async(blocks=first)
        assert not h.done
        time.sleep(1.0)  # the promotions land and are pinned for the ticket
        c.timeout_s = 1e-9  # this poll reaches the daemon; its reply is lost
        with pytest.raises(RequestTimeout):
            h.poll()
        c.timeout_s = 10.0
        with pytest.raises(EngineReclaimed):
            c.free(seqs=[1])
        deadline = time.monotonic() + 10
        while not c.reattach() and time.monotonic() < deadline:
            time.sleep(0.2)
        me = _mine(c)
        assert me["pins"] == 0 and me["live_blocks"] == 0
        c.check()
    finally:
        c.close()
        assert d.stop() == 0


def test_a_failed_register_leaves_the_client_unregistered_and_old_handles_dead(tmp_path):
    d = DaemonProcess(tmp_path, "tiers.hbm_bytes=16384", "tiers.dram_bytes=65536", "tiers.nvme_bytes=0")
    a, b = d.client(heartbeat_s=None), d.client(heartbeat_s=None)
    try:
        a.register(block_bytes=4096)
        b.register(block_bytes=4096)
        x, _ = a.alloc(1, seq=1)
        a.seal(x, [5])
        a.free(seqs=[1])
        b.alloc(4, seq=1, pin=True)  # HBM full: key 5's block waits in DRAM
        handle = a.acquire_async(blocks=a.ref([5], seq=2))
        assert not handle.done
        with pytest.raises(RequestRejected) as e:  # larger than the daemon's slots: refused
            a.register(block_bytes=8192)
        assert e.value.code == "conflict"
        assert a.info == {} and a.reclaimed  # not the old session, whatever the daemon still holds
        with pytest.raises(EngineReclaimed):
            a.ref([5])
        assert a.ping()["pong"]  # what needs no session still goes
        a.register(block_bytes=4096)  # a new session: the old one's handle never acts in it
        with pytest.raises(EngineReclaimed):
            handle.poll()
        b.release(seqs=[1])
        assert _mine(a)["pins"] == 0 and _mine(a)["live_blocks"] == len(a._lease)
        a.check()
    finally:
        a.close()
        b.close()
        assert d.stop() == 0


def test_telemetry_after_close_is_refused_and_opens_no_socket(tmp_path):
    d = DaemonProcess(tmp_path, f"tiers.hbm_bytes={8 * 4096}", "tiers.dram_bytes=0", "tiers.nvme_bytes=0")
    c = d.client(heartbeat_s=None)
    try:
        c.register(block_bytes=4096)
        c.report_segment([0], "system")  # opens the telemetry socket
        c.close()
        with pytest.raises(KvtierError, match="closed"):
            c.report_segment([0], "system")
        assert c.telemetry._push is None
    finally:
        c.close()
        assert d.stop() == 0


def test_telemetry_without_an_endpoint_is_dropped_not_raised(caplog):
    """An explicit RPC endpoint not named rpc.sock has no telemetry sibling: reports are
    fire-and-forget, so they are dropped (logged once), never raised into an engine's step."""
    import zmq

    from kvtier.client.replies import KvtierError
    from kvtier.client.telemetry import TelemetrySender

    ctx = zmq.Context()
    try:
        t = TelemetrySender(ctx, None, "e")
        t.send("segment", [1, 2], tag="user")  # no session yet: nothing to stamp with, dropped
        assert t.unstamped == 1 and t.dropped == 0
        t.start(12345)
        with caplog.at_level("WARNING", logger="kvtier.client"):
            t.send("segment", [1, 2], tag="user")
            t.send("segment", [3], tag="user")
        assert t.dropped == 2 and sum("no telemetry endpoint" in r.getMessage() for r in caplog.records) == 1
        t.close()
        with pytest.raises(KvtierError, match="closed"):
            t.send("segment", [1], tag="user")
    finally:
        ctx.term()


class _LateSocket:
    """The heartbeat thread's socket, its reply read only when ``go`` is set: the thread
    descheduled (the GIL, a busy engine) between sending and reading."""

    def __init__(self, sock) -> None:
        self.sock, self.sent, self.go = sock, threading.Event(), threading.Event()

    def send_multipart(self, frames):
        self.sock.send_multipart(frames)
        self.sent.set()

    def setsockopt(self, *option):
        self.sock.setsockopt(*option)

    def recv_multipart(self):
        self.go.wait(10)
        return self.sock.recv_multipart()


def test_an_old_sessions_reply_read_late_does_not_end_the_new_session(tmp_path):
    """The daemon ends session 1; the heartbeat thread's request of session 1 is answered
    ``unknown_engine`` but read only after the engine registered session 2. That reply is
    session 1's: session 2 goes on (it had ended it, the mapping dropped and every call
    refused while the daemon still held session 2)."""
    d = DaemonProcess(tmp_path, "tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=0")
    c = d.client(heartbeat_s=None, engine_id="eng")
    try:
        c.register(block_bytes=4096)
        c._call("unregister")  # the daemon ends session 1, as after a heartbeat timeout; the client does not know
        late = _LateSocket(c._dealer())
        got: dict = {}

        def heartbeat() -> None:
            try:
                c._call("heartbeat", sock=late)
            except KvtierError as e:
                got["error"] = e

        beat = threading.Thread(target=heartbeat)
        beat.start()
        assert late.sent.wait(10) and late.sock.poll(10_000)  # answered by the daemon before the register
        with pytest.raises(EngineReclaimed):
            c.alloc(1)
        assert c.reattach()
        late.go.set()
        beat.join(10)
        assert isinstance(got.get("error"), RequestRejected) and got["error"].code == "unknown_engine"
        assert c.reclaimed == "" and c.hbm is not None
        blocks, _ = c.alloc(1)  # session 2 is live on both sides
        assert blocks.size == 1 and _mine(c)["live_blocks"] >= 1
    finally:
        c.close()
        assert d.stop() == 0
