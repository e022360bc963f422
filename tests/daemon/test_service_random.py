"""Randomized operation sequences through the daemon's service: invariants after every step."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.daemon.config import load_config
from kvtier.daemon.service import Service
from kvtier.protocol import wire as P

STEPS = 600


def _service(tmp_path, policy: str) -> Service:
    cfg = load_config(environ={}, overrides=[
        "tiers.hbm_bytes=32768", "tiers.dram_bytes=32768", "tiers.nvme_bytes=65536", f'policy.name="{policy}"',
        f'tiers.nvme_dir="{tmp_path}/nvme"', f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"])
    return Service(cfg)


def _call(svc: Service, op: str, engine: str, **args):
    req, a = P.decode_request(P.pack({"v": 1, "id": 1, "op": op, "engine": engine, "args": args}), 1 << 20)
    return svc.handle(req, a)


@pytest.mark.parametrize("policy, seed", [("kvtier", 0), ("lru", 1), ("kvtier", 2), ("s3fifo", 3)])
def test_random_ops_keep_every_invariant(tmp_path, policy, seed):
    rng = np.random.default_rng(seed)
    svc = _service(tmp_path, policy)
    try:
        engines = ["a", "b"]
        for e in engines:
            _call(svc, "register", e, pid=0, block_bytes=4096)
        held: dict[str, list[int]] = {e: [] for e in engines}
        pinned: dict[str, list[int]] = {e: [] for e in engines}
        keys = iter(range(1, 10**6))
        outcomes = {"ok": 0, "rejected": 0, "waiting": 0}
        for step in range(STEPS):
            e = engines[int(rng.integers(2))]
            op = rng.choice(["alloc", "seal", "ref", "acquire", "release", "free", "hint", "telemetry"])
            try:
                if op == "alloc":
                    r = _call(svc, "alloc", e, n=int(rng.integers(1, 3)), seq=int(rng.integers(4)))
                    held[e] += np.frombuffer(r["blocks"], "<i8").tolist()
                elif op == "seal" and held[e]:
                    b = int(rng.choice(held[e]))
                    k = next(keys) if rng.random() < 0.7 else int(rng.integers(1, 50))  # some shared keys
                    c = int(np.frombuffer(_call(svc, "seal", e, blocks=[b], keys=[k])["blocks"], "<i8")[0])
                    held[e] = [c if x == b else x for x in held[e]]
                    if c != b:  # folded into a shared block: the daemon dropped our pins on b
                        pinned[e] = [x for x in pinned[e] if x != b]
                elif op == "ref":
                    got = np.frombuffer(_call(svc, "ref", e, keys=[int(rng.integers(1, 60))])["blocks"], "<i8")
                    held[e] += [int(x) for x in got if x >= 0]
                elif op == "acquire" and held[e]:
                    pick = sorted(set(rng.choice(held[e], size=min(3, len(held[e])), replace=False).tolist()))
                    r = _call(svc, "acquire", e, blocks=pick, timeout_s=0.5, wait=False)
                    if r.get("done"):
                        pinned[e] += pick
                    else:
                        outcomes["waiting"] += 1
                elif op == "release" and pinned[e]:
                    b = pinned[e].pop(int(rng.integers(len(pinned[e]))))
                    _call(svc, "release", e, blocks=[b])
                elif op == "free" and held[e]:
                    b = int(rng.choice(held[e]))
                    _call(svc, "free", e, blocks=[b])
                    held[e].remove(b)
                elif op == "hint" and held[e]:
                    _call(svc, "hint", e, blocks=sorted(set(held[e][:4])), deadline_s=0.01)
                elif op == "telemetry" and held[e]:
                    bl = np.asarray(sorted(set(held[e][:5])), dtype=np.int64)
                    svc.ingest({"v": 1, "engine": e, "kind": "attention", "blocks": P.id_bytes(bl),
                                "mass": rng.random(bl.size).astype("<f4").tobytes()})
                outcomes["ok"] += 1
            except P.ProtocolError as err:
                assert err.code in {P.INVALID, P.NO_SPACE, P.TIMEOUT}, err.message
                outcomes["rejected"] += 1
            svc.background()
            svc.advance()
            svc.maintain()
            if step % 7 == 0:
                svc.node.mgr.wait(timeout=10)
                svc.background()
            assert _call(svc, "check", "") == {"ok": True}
            for eng in engines:  # the daemon's per-engine pins match what the engine believes it holds
                sess = svc.engines[eng]
                for b in set(pinned[eng]):
                    assert sess.pins[b] >= pinned[eng].count(b)
        assert outcomes["ok"] > 300
        svc.reclaim("a", "test")  # one engine goes: the other's blocks and pins are untouched
        assert _call(svc, "check", "") == {"ok": True}
        for b in set(pinned["b"]):
            assert svc.node.mgr.table.pins[b] >= pinned["b"].count(b)
    finally:
        svc.close()
