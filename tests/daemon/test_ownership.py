"""A daemon owns its directories alone, answers every frame, and tells a reclaimed engine."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import zmq

from kvtier.bench.spawn import DaemonProcess
from kvtier.client.tier_client import EngineReclaimed
from kvtier.daemon.config import ConfigError, load_config

SMALL = ("tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=262144")


@pytest.fixture(autouse=True)
def _roots(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()


def test_a_second_daemon_on_the_same_runtime_dir_is_refused_and_the_first_keeps_serving(tmp_path):
    a = DaemonProcess(tmp_path / "a", *SMALL)
    try:
        with pytest.raises(RuntimeError, match="holds the runtime directory"):
            DaemonProcess(tmp_path / "b", *SMALL, f'server.runtime_dir="{a.runtime_dir}"')
        with a.client(heartbeat_s=None) as c:  # its sockets are still there: nobody deleted them
            assert c.ping()["pong"]
    finally:
        assert a.stop() == 0, a.read_log()


def test_a_second_daemon_on_the_same_nvme_dir_is_refused(tmp_path):
    a = DaemonProcess(tmp_path / "a", *SMALL)
    try:
        with pytest.raises(RuntimeError, match="holds the NVMe directory"):
            DaemonProcess(tmp_path / "b", *SMALL, f'tiers.nvme_dir="{a.nvme_dir}"')
    finally:
        assert a.stop() == 0, a.read_log()
    b = DaemonProcess(tmp_path / "b", *SMALL, f'tiers.nvme_dir="{a.nvme_dir}"')  # free again once a stopped
    assert b.stop() == 0, b.read_log()


def test_one_directory_for_sockets_and_slabs_is_one_lock(tmp_path):
    """The NVMe lock on the runtime directory was refused by the daemon's own runtime lock, and
    blamed "another kvtier daemon" with the daemon's own pid."""
    d = DaemonProcess(tmp_path / "b", *SMALL, f'tiers.nvme_dir="{tmp_path / "b" / "run"}"')  # its runtime dir
    try:
        with d.client(heartbeat_s=None) as c:
            assert c.ping()["pong"]
    finally:
        assert d.stop() == 0, d.read_log()


def test_an_oversized_frame_gets_a_too_large_reply(tmp_path):
    d = DaemonProcess(tmp_path, *SMALL, "server.max_message_bytes=65536")
    try:
        s = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(d.info["rpc"])
        big = msgpack.packb({"v": 1, "id": 9, "op": "ping", "engine": "", "args": {"pad": b"x" * 70000}})
        s.send_multipart([b"", big])
        reply = msgpack.unpackb(s.recv_multipart()[-1], raw=False)  # used to be no reply at all
        assert not reply["ok"] and reply["error"]["code"] == "too_large"
        s.close(0)
    finally:
        assert d.stop() == 0, d.read_log()


def test_tcp_rpc_is_refused_by_config():
    with pytest.raises(ConfigError, match="not served"):
        load_config(environ={}, overrides=["server.tcp_port=5557"])


def test_a_reclaimed_engine_is_told_and_stops_writing(tmp_path):
    d = DaemonProcess(tmp_path, *SMALL, "server.heartbeat_timeout_s=0.5")
    try:
        with d.client(engine_id="slow", heartbeat_s=None) as c:  # silent: no heartbeats at all
            c.register(block_bytes=4096)
            blocks, slots = c.alloc(2, seq=1, pin=True)
            time.sleep(1.5)  # judged silent (its process is alive: its pins are fenced, not reused)
            with pytest.raises(EngineReclaimed):
                c.alloc(1, seq=2)
            with pytest.raises(EngineReclaimed):
                c.slot_view(int(slots[0]))[:] = 7  # no more writes through this client
            with pytest.raises(EngineReclaimed):
                c.release(blocks=blocks)
        with d.client(engine_id="watch", heartbeat_s=None) as w:
            s = w.stats()
        assert s["service"]["reclaimed_timeout"] == 1 and s["service"]["fenced_pins"] == 2
        assert not np.isin(["slow"], [e["engine"] for e in s["engines"]]).any()
    finally:
        assert d.stop() == 0, d.read_log()


def test_admin_ops_need_the_owner_token(tmp_path):
    from kvtier.client.tier_client import RequestRejected, TierClient

    d = DaemonProcess(tmp_path / "a", *SMALL)
    try:
        token = d.runtime_dir / "admin.token"
        assert token.stat().st_mode & 0o777 == 0o600
        with d.client(engine_id="owner", heartbeat_s=None) as owner:
            owner.register(block_bytes=4096)
            # an engine that has the socket but not the runtime dir's token (a container, say)
            with TierClient(endpoint=d.info["rpc"], runtime_dir=str(tmp_path / "b"), engine_id="guest",
                            heartbeat_s=None) as guest:
                for call in (guest.clear, guest.reload, guest.check):
                    with pytest.raises(RequestRejected) as e:
                        call()
                    assert e.value.code == "forbidden"
                seen = guest.stats()["engines"]
                assert seen and all(e["pid"] == 0 and e["engine"] != "owner" for e in seen)
            assert owner.check()["ok"] and owner.clear() == 0
            assert {e["engine"] for e in owner.stats()["engines"]} == {"owner"}
    finally:
        assert d.stop() == 0, d.read_log()
    assert not token.exists()
