"""A move's events go to each listener once, as an array (``batch_listeners``): the daemon's
state after any sequence is exactly what one call a block leaves (policies, membership, KV
events, prefetcher), so the batch path is an optimisation and nothing else."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.daemon.config import load_config
from kvtier.daemon.service import Service
from kvtier.protocol.wire import ProtocolError

from .service_calls import Clock, call, ids, pump


def _service(tmp_path, name: str, clock: Clock, policy: str) -> Service:
    cfg = load_config(environ={}, overrides=[
        "tiers.hbm_bytes=32768", "tiers.dram_bytes=65536", "tiers.nvme_bytes=0",  # one copy lane: a fixed order
        f'server.runtime_dir="{tmp_path}/{name}"', "metrics.enabled=false", "policy.speculate=true",
        f'policy.name="{policy}"'])
    s = Service(cfg, clock=clock)
    call(s, "register", "e", pid=0, block_bytes=4096)
    return s


def _step(s: Service) -> list:
    pump(s, rounds=1)
    batch = s.node.events.take_batch()
    return [] if batch is None else batch[1]


def _state(s: Service) -> list:
    out = [s.node.placement.tracked.copy(), s.node.prefetcher._spec.copy(), s.node.mgr.table.copies.copy()]
    for pol in s.node.placement.policies.values():
        out += [v.copy() for v in vars(pol).values() if isinstance(v, np.ndarray)]
        if hasattr(pol, "model"):
            out += [v.copy() for v in vars(pol.model).values() if isinstance(v, np.ndarray)]
    return out


def _apply(s: Service, live: list[int], op: str, n: int, picks: list[int], key: int) -> None:
    """One op of the sequence (the same draws for both services); a refusal changes nothing."""
    try:
        if op == "alloc":
            got = ids(call(s, "alloc", n=n)["blocks"])
            live += ids(call(s, "seal", blocks=got, keys=list(range(key, key + n)))["blocks"])
        elif live and op == "acquire":
            pick = sorted({live[p % len(live)] for p in picks})
            if call(s, "acquire", blocks=pick, wait=False)["done"]:
                call(s, "release", blocks=pick)
        elif live and op == "free":
            call(s, "free", blocks=[live.pop(picks[0] % len(live))])
        elif live and op == "hint":
            call(s, "hint", blocks=sorted({live[p % len(live)] for p in picks}), deadline_s=0.5)
    except ProtocolError:
        pass


@pytest.mark.parametrize("policy, seed", [("kvtier", 0), ("kvtier", 1), ("kvtier", 2), ("lru", 0), ("s3fifo", 0)])
def test_batch_listeners_leave_the_state_one_call_a_block_leaves(tmp_path, policy, seed):
    clocks = (Clock(), Clock())
    batched, single = _service(tmp_path, "a", clocks[0], policy), _service(tmp_path, "b", clocks[1], policy)
    single.node.mgr.batch_listeners.clear()  # every listener once per block, as before
    try:
        assert len(batched.node.mgr.batch_listeners) == len(batched.node.mgr.listeners) >= 4
        rng = np.random.default_rng(seed)
        live: tuple[list[int], list[int]] = ([], [])
        for i in range(150):
            op, n = str(rng.choice(["alloc", "alloc", "acquire", "free", "hint"])), int(rng.integers(1, 4))
            picks = rng.integers(0, 1 << 30, size=3).tolist()
            for s, c, lv in zip((batched, single), clocks, live):
                c.t += 0.25
                _apply(s, lv, op, n, picks, 1 + 8 * i)
            assert live[0] == live[1]
            assert _step(batched) == _step(single)  # the same KV events, in the same order
        for a, b in zip(_state(batched), _state(single)):
            assert np.array_equal(a, b, equal_nan=True)
        assert int(batched.node.mgr.table.copies.astype(bool).sum()) > 0
        batched.node.mgr.check_invariants()
    finally:
        batched.close()
        single.close()
