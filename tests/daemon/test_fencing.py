"""Fencing and liveness: a silent engine's slots are never handed to another engine while
its process may still write them; pids are judged only where they mean something."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvtier.daemon.config import load_config
from kvtier.daemon.liveness import own_pid_namespace
from kvtier.daemon.service import Service
from kvtier.protocol import wire as P

from .service_calls import Clock, call, ids

BB = 4096


@pytest.fixture
def env(tmp_path):
    cfg = load_config(environ={}, overrides=[
        f"tiers.hbm_bytes={8 * BB}", "tiers.dram_bytes=0", "tiers.nvme_bytes=0", 'policy.name="lru"',
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false", "server.heartbeat_timeout_s=1.0",
        "server.fence_timeout_s=30.0"])
    clock = Clock()
    svc = Service(cfg, clock=clock)
    yield svc, clock
    svc.close()


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_silent_live_engine_keeps_its_slots_fenced_until_its_process_dies(env):
    svc, clock = env
    proc = _sleeper()
    try:
        call(svc, "register", "stalled", pid=proc.pid, pid_ns=own_pid_namespace(), block_bytes=BB)
        call(svc, "register", "other", pid=0, block_bytes=BB)
        mine = set(ids(call(svc, "alloc", "stalled", n=4, seq=1, pin=True)["slots"]))
        clock.t += 5  # "stalled" (SIGSTOPped, say) misses its heartbeats; "other" keeps beating
        call(svc, "heartbeat", "other")
        assert svc.check_engines() == ["stalled"]
        with pytest.raises(P.ProtocolError) as e:  # it learns at its next call
            call(svc, "alloc", "stalled", n=1)
        assert e.value.code == P.UNKNOWN_ENGINE
        got = call(svc, "alloc", "other", n=4, seq=2, pin=True)  # everything that is free
        assert not mine & set(ids(got["slots"])), "a fenced slot went to another engine"
        with pytest.raises(P.ProtocolError):  # and no more than that: the fenced slots stay out
            call(svc, "alloc", "other", n=1)
        assert call(svc, "check", "other")["ok"]
        proc.kill()
        proc.wait()
        svc.check_engines()  # its process is gone: nothing can write the slots any more
        assert svc.counters["fences_lifted"] == 1
        freed = set(ids(call(svc, "alloc", "other", n=4, seq=3, pin=True)["slots"]))
        assert freed == mine
        assert call(svc, "check", "other")["ok"]
    finally:
        proc.kill()


def test_an_engine_in_another_pid_namespace_is_judged_by_heartbeats_alone(env):
    svc, clock = env
    dead = _sleeper()
    dead.kill()
    dead.wait()  # a pid that names no process here
    call(svc, "register", "container", pid=dead.pid, pid_ns=own_pid_namespace() + 1, block_bytes=BB)
    blocks = ids(call(svc, "alloc", "container", n=2, seq=1, pin=True)["blocks"])
    clock.t += 0.5
    assert svc.check_engines() == []  # its pid means nothing here: not "process died"
    call(svc, "heartbeat", "container")
    clock.t += 0.9
    assert svc.check_engines() == []
    assert svc.engines["container"].pins[blocks].tolist() == [1, 1]
    clock.t += 1.5  # silent now: reclaimed, and its pins fenced for fence_timeout_s (its process is invisible)
    assert svc.check_engines() == ["container"]
    assert len(svc.fences) == 1
    clock.t += 31
    svc.check_engines()
    assert not svc.fences and svc.counters["fences_lifted"] == 1


def test_a_pid_beyond_any_pid_max_neither_crashes_nor_reclaims(env):
    svc, clock = env
    call(svc, "register", "huge", pid=2 ** 31, block_bytes=BB)
    call(svc, "register", "huger", pid=2 ** 62, pid_ns=own_pid_namespace(), block_bytes=BB)
    assert svc.check_engines() == []  # os.kill(2**31, 0) used to raise OverflowError out of the loop
    with pytest.raises(P.ProtocolError):
        call(svc, "register", "neg", pid=-1, block_bytes=BB)
    with pytest.raises(P.ProtocolError):
        call(svc, "register", "toolarge", pid=2 ** 64 - 1, block_bytes=BB)


def test_a_dead_engine_is_reclaimed_at_once_and_its_slots_reused(env):
    svc, clock = env
    proc = _sleeper()
    call(svc, "register", "gone", pid=proc.pid, pid_ns=own_pid_namespace(), block_bytes=BB)
    mine = set(ids(call(svc, "alloc", "gone", n=8, seq=1, pin=True)["slots"]))
    proc.kill()
    proc.wait()
    assert svc.check_engines() == ["gone"]
    assert not svc.fences
    call(svc, "register", "next", pid=os.getpid(), pid_ns=own_pid_namespace(), block_bytes=BB)
    assert set(ids(call(svc, "alloc", "next", n=8, seq=1, pin=True)["slots"])) == mine


def test_waiters_of_a_reclaimed_engine_are_told(env):
    svc, clock = env
    call(svc, "register", "a", pid=0, block_bytes=BB)
    call(svc, "alloc", "a", n=8, seq=1, pin=True)  # HBM full of pinned blocks
    w = call(svc, "alloc", "a", n=2, seq=2, pin=True, wait=True, timeout_s=60)
    assert w.__class__.__name__ == "AllocWaiter"
    svc.reclaim("a", "unregistered")
    out = svc.advance()
    assert len(out) == 1 and out[0][0] is w
    assert isinstance(out[0][1], P.ProtocolError) and out[0][1].code == P.UNKNOWN_ENGINE


def test_a_block_in_an_unfinished_acquire_cannot_be_sealed_away(tmp_path):
    """Sealing folds a block into a shared one and drops the engine's pins on it; pins an
    unfinished acquire holds must not go with them (its mask would name a freed block)."""
    cfg = load_config(environ={}, overrides=[
        f"tiers.hbm_bytes={4 * BB}", f"tiers.dram_bytes={8 * BB}", "tiers.nvme_bytes=0", 'policy.name="lru"',
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"])
    svc = Service(cfg)
    try:
        call(svc, "register", "e", pid=0, block_bytes=BB)
        shared = ids(call(svc, "alloc", "e", n=1, seq=9, pin=True)["blocks"])
        call(svc, "seal", "e", blocks=shared, keys=P.id_bytes(np.array([7], np.uint64), np.uint64), seq=9)
        c = ids(call(svc, "alloc", "e", n=1, seq=2)["blocks"])
        call(svc, "seal", "e", blocks=c, keys=P.id_bytes(np.array([5], np.uint64), np.uint64), seq=2)
        svc.node.mgr.demote(c, "hbm", "dram")
        svc.node.mgr.wait(timeout=10)
        b = ids(call(svc, "alloc", "e", n=1, seq=1, pin=True)["blocks"])
        r = call(svc, "acquire", "e", blocks=[b[0], c[0]], wait=False, timeout_s=10)  # b pinned, c on its way
        assert not r["done"]
        with pytest.raises(P.ProtocolError) as e:
            call(svc, "seal", "e", blocks=b, keys=P.id_bytes(np.array([7], np.uint64), np.uint64), seq=1)
        assert e.value.code == P.INVALID and "unfinished acquire" in e.value.message
        svc.node.mgr.wait(timeout=10)
        assert call(svc, "acquire_poll", "e", ticket=r["ticket"])["done"]
        svc.node.mgr.check_invariants()
        assert call(svc, "check", "e")["ok"]
    finally:
        svc.close()


def test_a_fenced_engine_that_registers_again_gets_its_slots_back(env):
    svc, clock = env
    call(svc, "register", "e", pid=os.getpid(), pid_ns=own_pid_namespace(), block_bytes=BB)  # alive: fenced
    mine = set(ids(call(svc, "alloc", "e", n=8, seq=1, pin=True)["slots"]))
    clock.t += 5
    assert svc.check_engines() == ["e"] and len(svc.fences) == 1
    call(svc, "register", "e", pid=os.getpid(), pid_ns=own_pid_namespace(), block_bytes=BB)  # starts over
    assert not svc.fences and svc.counters["fences_lifted"] == 1
    assert set(ids(call(svc, "alloc", "e", n=8, seq=1, pin=True)["slots"])) == mine
    assert call(svc, "check", "e")["ok"]


@pytest.mark.parametrize("checked_first", [True, False], ids=["timed-out-first", "replaced-directly"])
def test_another_process_taking_a_silent_engines_id_keeps_its_pins_fenced(env, checked_first):
    """An engine in another pid namespace goes silent past the timeout and another process
    registers its id. Whether the heartbeat check reclaimed it first or the register does,
    its pins stay fenced: no other engine gets the slots it may still be writing (the
    register had dropped them at once)."""
    svc, clock = env
    other_ns = own_pid_namespace() + 1
    call(svc, "register", "w", pid=100, pid_ns=other_ns, block_bytes=BB)
    call(svc, "register", "b", pid=0, block_bytes=BB)
    mine = set(ids(call(svc, "alloc", "w", n=4, seq=1, pin=True)["slots"]))
    clock.t += 1.5
    call(svc, "heartbeat", "b")
    if checked_first:
        assert svc.check_engines() == ["w"]
    call(svc, "register", "w", pid=200, pid_ns=other_ns, block_bytes=BB)  # another process, same id
    assert len(svc.fences) == 1 and svc.fences[0].process == (100, other_ns)
    assert svc.node.mgr.table.free_slot_count(0) == 4  # HBM: w's four slots are not free
    got = set(ids(call(svc, "alloc", "b", n=4, seq=2, pin=True)["slots"]))
    assert not mine & got
    assert svc.counters["reclaimed_timeout" if checked_first else "reclaimed_replaced"] == 1
