"""Who holds what: an engine id names one process, an unfinished acquire names the block it
was made for (not whatever takes its id), and a free drops every reference it names."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvtier.daemon.config import load_config
from kvtier.daemon.liveness import own_pid_namespace
from kvtier.daemon.namespaces import Namespaces
from kvtier.daemon.service import Service
from kvtier.protocol import wire as P
from kvtier.tiers.types import DRAM, HBM

from .service_calls import Clock, call, ids

BB = 4096


@pytest.fixture
def env(tmp_path):
    cfg = load_config(environ={}, overrides=[
        f"tiers.hbm_bytes={4 * BB}", f"tiers.dram_bytes={4 * BB}", "tiers.nvme_bytes=0", 'policy.name="lru"',
        "tiers.max_blocks=5", f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false",
        "server.heartbeat_timeout_s=2.0"])
    clock = Clock()
    svc = Service(cfg, clock=clock)
    yield svc, clock
    svc.close()


def _register(svc, engine, pid_ns=None, namespace="", pid=None):
    return call(svc, "register", engine, pid=os.getpid() if pid is None else pid,
                pid_ns=own_pid_namespace() if pid_ns is None else pid_ns, block_bytes=BB, namespace=namespace)


def _keys(*k):
    return P.id_bytes(np.array(k, dtype=np.uint64), np.uint64)


def _cached(svc, engine, key, fill):
    """A sealed block of ``key`` holding ``fill`` bytes, no reference left (a cached block)."""
    b = ids(call(svc, "alloc", engine, n=1, seq=key, pin=True)["blocks"])[0]
    svc.node.mgr.write(b, bytes([fill]) * BB)
    call(svc, "release", engine, blocks=[b])
    b = ids(call(svc, "seal", engine, blocks=[b], keys=_keys(key))["blocks"])[0]
    call(svc, "free", engine, blocks=[b])
    return b


def test_an_acquire_whose_block_was_freed_fails_and_never_pins_the_block_that_took_its_id(env):
    svc, _ = env
    _register(svc, "a", namespace="tenant-a")
    _register(svc, "b", namespace="tenant-b")
    mgr = svc.node.mgr
    k = _cached(svc, "a", 5, 0xAA)
    mgr.demote([k], HBM, DRAM)
    mgr.wait()
    full = ids(call(svc, "alloc", "a", n=4, seq=2, pin=True)["blocks"])  # HBM full: the acquire waits
    r = call(svc, "acquire", "a", keys=_keys(5), wait=False)
    assert not r["done"]
    call(svc, "clear", "x")  # the cached block is dropped while the acquire waits
    assert not mgr.table.is_valid_block(k)
    call(svc, "release", "a", blocks=[full[0]])
    call(svc, "free", "a", blocks=[full[0]])
    got = call(svc, "alloc", "b", n=1, seq=1, pin=True)  # another tenant's block takes the id
    assert ids(got["blocks"]) == [k]
    mgr.write(k, b"\xbb" * BB)
    with pytest.raises(P.ProtocolError) as e:
        call(svc, "acquire_poll", "a", ticket=r["ticket"])
    assert e.value.code == P.INVALID and "freed while the acquire waited" in str(e.value)
    assert svc.engines["a"].pins[k] == 0 and int(mgr.table.pins[k]) == 1  # only b's own pin
    assert call(svc, "check", "x")["ok"]


def test_a_blocking_acquire_whose_block_was_freed_is_answered_with_the_error(env):
    svc, _ = env
    _register(svc, "a", namespace="m")
    mgr = svc.node.mgr
    k = _cached(svc, "a", 6, 0xAA)
    mgr.demote([k], HBM, DRAM)
    mgr.wait()
    full = ids(call(svc, "alloc", "a", n=4, seq=2, pin=True)["blocks"])
    w = call(svc, "acquire", "a", keys=_keys(6), wait=True)  # a waiter: answered by the owner loop
    call(svc, "clear", "x")
    call(svc, "release", "a", blocks=[full[0]])
    done = [result for waiter, result in svc.advance() if waiter is w]
    assert len(done) == 1 and isinstance(done[0], P.ProtocolError)
    assert "freed while the acquire waited" in str(done[0])
    assert call(svc, "check", "x")["ok"]


def test_a_second_live_process_cannot_take_over_an_engine_id(env):
    svc, clock = env
    _register(svc, "worker-0", pid_ns=own_pid_namespace() + 1)  # a container: judged by heartbeats
    mine = ids(call(svc, "alloc", "worker-0", n=2, seq=1, pin=True)["slots"])
    with pytest.raises(P.ProtocolError) as e:  # another container's process, same id
        _register(svc, "worker-0", pid_ns=own_pid_namespace() + 2)
    assert e.value.code == P.CONFLICT and "unique id" in str(e.value)
    assert svc.engines["worker-0"].pins.nonzero_ids().size == 2  # nothing of the first was touched
    assert ids(call(svc, "acquire", "worker-0", seqs=[1])["slots"]) == mine
    clock.t += 3.0  # silent past the heartbeat timeout: a restart may take the id over
    _register(svc, "worker-0", pid_ns=own_pid_namespace() + 2)
    assert svc.engines["worker-0"].pins.nonzero_ids().size == 0
    assert call(svc, "check", "x")["ok"]


def test_the_same_process_registering_again_starts_over(env):
    svc, _ = env
    _register(svc, "e")
    call(svc, "alloc", "e", n=2, seq=1, pin=True)
    _register(svc, "e")  # same pid, same pid namespace: a restart of its session
    assert svc.engines["e"].pins.nonzero_ids().size == 0 and not svc.engines["e"].refs
    assert svc.node.mgr.table.n_live_entries() == 0
    assert call(svc, "check", "x")["ok"]


def test_a_dead_process_id_is_taken_over_at_once(env):
    svc, _ = env
    _register(svc, "e", pid=2 ** 21 + 12345)  # a pid here that names no process
    call(svc, "alloc", "e", n=2, seq=1, pin=True)
    _register(svc, "e")
    assert svc.node.mgr.table.n_live_entries() == 0


def test_an_exited_process_not_yet_reaped_gives_its_id_up(env):
    svc, _ = env
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        for _ in range(100):  # exited, not reaped: kill(pid, 0) still finds it
            if open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.05)
        _register(svc, "e", pid=child.pid)
        call(svc, "alloc", "e", n=2, seq=1, pin=True)
        _register(svc, "e")  # a restart of the engine: not refused as a second live process
        assert svc.node.mgr.table.n_live_entries() == 0
    finally:
        child.wait()


def test_a_register_refused_late_leaves_the_old_session_whole(env, monkeypatch):
    svc, _ = env
    _register(svc, "e", namespace="m")
    held = ids(call(svc, "alloc", "e", n=2, seq=1, pin=True)["blocks"])

    def full(self, name, geometry):  # the namespace table is full (65,535 of them)
        raise ValueError("more than 65535 namespaces")

    monkeypatch.setattr(Namespaces, "id", full)
    with pytest.raises(ValueError):  # the server answers it as "invalid"
        _register(svc, "e", namespace="another")
    assert "e" in svc.engines and svc.engines["e"].pins.nonzero_ids().tolist() == held
    assert svc.node.mgr.table.pins[held].tolist() == [1, 1]


def test_free_of_sequences_drops_every_reference_they_took(env):
    svc, _ = env
    _register(svc, "e", namespace="m")
    t = svc.node.mgr.table
    b = _cached(svc, "e", 7, 0x11)
    assert ids(call(svc, "ref", "e", keys=_keys(7, 7), seq=2)["blocks"]) == [b, b]  # a prompt repeating a block
    call(svc, "ref", "e", keys=_keys(7), seq=3)  # another sequence sharing it
    assert int(t.refcount[b]) == 3
    call(svc, "free", "e", seqs=[2, 3])
    assert int(t.refcount[b]) == 0 and not svc.engines["e"].refs and not svc.engines["e"].seqs
    assert call(svc, "clear", "x")["dropped"] == 1  # cached again, so it can go
    assert call(svc, "check", "x")["ok"]


def test_free_of_a_sequence_after_one_of_its_blocks_was_freed_by_id(env):
    svc, _ = env
    _register(svc, "e", namespace="m")
    t = svc.node.mgr.table
    b = _cached(svc, "e", 8, 0x22)
    call(svc, "ref", "e", keys=_keys(8, 8), seq=2)
    call(svc, "free", "e", blocks=[b])  # one of the two references, by id
    assert int(t.refcount[b]) == 1
    call(svc, "free", "e", seqs=[2])  # the sequence still lists it twice: frees what is left
    assert int(t.refcount[b]) == 0 and not svc.engines["e"].refs
    with pytest.raises(P.ProtocolError):
        call(svc, "free", "e", blocks=[b])  # nothing held any more: refused, nothing changes
    assert call(svc, "check", "x")["ok"]


def test_a_fence_of_another_process_is_not_lifted_by_a_register_of_its_id(env):
    svc, clock = env
    _register(svc, "e", pid_ns=own_pid_namespace() + 1)
    slots = set(ids(call(svc, "alloc", "e", n=4, seq=1, pin=True)["slots"]))
    clock.t += 3.0
    assert svc.check_engines() == ["e"]  # silent: fenced, its process may still write
    assert len(svc.fences) == 1
    _register(svc, "e", pid_ns=own_pid_namespace() + 2)  # another process takes the id
    assert len(svc.fences) == 1  # the old one may still write its slots
    with pytest.raises(P.ProtocolError):
        call(svc, "alloc", "e", n=1, pin=True)  # every HBM slot is still fenced
    assert slots and call(svc, "check", "x")["ok"]
