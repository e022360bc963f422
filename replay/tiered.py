"""Multi-tier replay: HBM and DRAM caches over an NVMe tier that keeps everything, per node,
optionally for N nodes sharing a remote tier.

The same policy objects rank each upper tier. A block found in HBM is an HBM
hit; found in DRAM, it is a DRAM hit and moves up if HBM's policy admits it
(tiers are exclusive), else it stays in DRAM; otherwise, if this node ever
wrote it, NVMe serves it; else, with a remote tier, a block another node
published is a remote hit (and is then this node's, like a block it computed);
anything else is a miss (computed). HBM victims, and blocks HBM's policy
declines, are offered to DRAM, whose policy may decline them too (admission),
in which case they remain only on NVMe. Estimated stall = bytes promoted per
tier / that tier's bandwidth, the time an engine would wait if nothing were
prefetched (in fleet mode the mean per node: the fleet's total over the nodes).

Fleet mode (``nodes`` > 1 or a remote capacity): the trace's requests are
spread round-robin over the nodes (a load balancer without prefix affinity),
each node with its own HBM, DRAM and NVMe. The remote tier follows the daemon's
rule, not all of its checks: a node publishes a block once it reused it itself
(``publish_min_shares`` = 1: the block is shared; 0 publishes every block a node
computes, a write-through), and the cluster evicts allkeys-LRU at its capacity.
The daemon also publishes only what its DRAM policy admits at demotion; the
replay does not model that admission, so its remote hits and writes are an
upper bound of the daemon's. The
fleet-wide hit ratio is 1 - miss: every read some tier of some node served.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from kvtier.policy import make_policy
from kvtier.replay.sim import NotResident
from kvtier.replay.traces import Trace


@dataclass
class TierSpec:
    hbm_blocks: int
    dram_blocks: int
    block_bytes: int = 2 << 20  # 512 tokens of a mid-size model
    dram_bytes_per_s: float = 20e9
    nvme_bytes_per_s: float = 5e9
    nodes: int = 1
    remote_blocks: int = 0  # the shared remote tier's capacity (0: none)
    remote_bytes_per_s: float = 2.5e9  # one node's network share (~25 Gbit/s)
    publish_min_shares: int = 1  # as [tiers.remote]: 1 publishes a block a node reused; 0 every block it wrote


def _victim(pol: Any, now: float, where: np.ndarray, tier: int, name: str) -> int:
    """``pol.evict(now)``, checked: the victim must be a block this tier holds."""
    v = pol.evict(now)
    if not (0 <= v < where.size and where[v] == tier):
        raise NotResident(pol.name, v, name)
    return v


def _offer(dram: Any, b: int, now: float, c: int, where: np.ndarray, demoted: bool = False) -> None:
    """Place ``b`` in DRAM if its policy admits it (else it lives on NVMe only). A block just
    read that HBM declined is valued as just accessed (``admit``); an HBM victim (``demoted``)
    as the daemon values one (``admit_many``: its own class, stage and age since its last
    access), not as if it had just been read."""
    if demoted:
        ok = bool(dram.admit_many(np.array([b], dtype=np.int64), np.array([c], dtype=np.int64))[0])
    else:
        ok = dram.admit(b, now, c, -1)
    if ok:
        if dram.size >= dram.capacity:
            where[_victim(dram, now, where, 2, "DRAM")] = 0
        dram.insert(b, now, c, -1)
        where[b] = 2


class _Node:
    """One node's HBM and DRAM policies and what its NVMe holds."""

    def __init__(self, policy: str, spec: TierSpec, n: int, params: dict[str, Any]) -> None:
        self.hbm = make_policy(policy, spec.hbm_blocks, n, **params)
        self.dram = make_policy(policy, spec.dram_blocks, n, **params)
        self.where = np.zeros(n, dtype=np.int8)  # 0 none, 1 hbm, 2 dram
        self.written = np.zeros(n, dtype=bool)
        self.cls = np.zeros(n, dtype=np.int64)  # each block's feature class at its last access

    def access(self, b: int, now: float, c: int, remote: Optional[Any]) -> str:
        hbm, dram, where = self.hbm, self.dram, self.where
        hbm.observe(b, now, c)
        dram.observe(b, now, c)
        self.cls[b] = c
        w = where[b]
        if w == 1:
            hbm.on_hit(b, now, c, -1)
            return "hbm"
        if w == 2:
            found = "dram"
            dram.on_hit(b, now, c, -1)  # DRAM's policy learns from its own hits
        elif self.written[b]:
            found = "nvme"
        else:
            found = "remote" if remote is not None and remote.has(b, now) else "miss"
            self.written[b] = True
        if hbm.admit(b, now, c, -1):  # promote (tiers are exclusive: the DRAM copy goes)
            if w == 2:
                dram.remove(b)
                where[b] = 0  # in neither tier until HBM's insert below
            if hbm.size >= hbm.capacity:
                v = _victim(hbm, now, where, 1, "HBM")
                where[v] = 0
                _offer(dram, v, now, int(self.cls[v]), where, demoted=True)  # may go one tier down
            hbm.insert(b, now, c, -1)
            where[b] = 1
        elif w != 2:  # not worth HBM: maybe worth DRAM, rather than NVMe only
            _offer(dram, b, now, c, where)
        return found


class _Remote:
    """The shared cluster: published blocks, evicted LRU at its capacity (Redis allkeys-lru)."""

    def __init__(self, capacity: int, n: int) -> None:
        self.lru = make_policy("lru", capacity, n)
        self.held = np.zeros(n, dtype=bool)
        self.writes = 0  # blocks written to the cluster (its network and memory cost)

    def has(self, b: int, now: float) -> bool:
        if self.held[b]:
            self.lru.on_hit(b, now, 0, -1)
        return bool(self.held[b])

    def publish(self, b: int, now: float) -> None:
        if self.held[b]:
            return
        self.writes += 1
        if self.lru.size >= self.lru.capacity:
            v = self.lru.evict(now)
            if not (0 <= v < self.held.size and self.held[v]):
                raise NotResident(self.lru.name, v, "the remote tier")
            self.held[v] = False
        self.lru.insert(b, now, 0, -1)
        self.held[b] = True


def simulate_tiers(policy: str, spec: TierSpec, trace: Trace, params: Optional[dict[str, Any]] = None,
                   progress: Optional[Callable[[int], None]] = None, chunk: int = 20000) -> dict[str, Any]:
    params = params or {}
    n_nodes = max(1, spec.nodes)
    nodes = [_Node(policy, spec, trace.n_unique, params) for _ in range(n_nodes)]
    remote = _Remote(spec.remote_blocks, trace.n_unique) if spec.remote_blocks > 0 else None
    counts = {"hbm": 0, "dram": 0, "nvme": 0, "remote": 0, "miss": 0}
    t0 = time.perf_counter()
    blocks, times, classes = trace.block.tolist(), trace.time_s.tolist(), trace.cls.tolist()
    node_of = (trace.request % n_nodes).tolist() if n_nodes > 1 else None
    for i, b in enumerate(blocks):
        now, c = times[i], classes[i]
        found = nodes[node_of[i] if node_of is not None else 0].access(b, now, c, remote)
        counts[found] += 1
        if remote is not None and (found in ("hbm", "dram", "nvme") or (found == "miss" and not spec.publish_min_shares)):
            remote.publish(b, now)  # reused on this node: a shared block, worth the fleet's memory
        if progress is not None and i % chunk == chunk - 1:
            progress(chunk)
    if progress is not None:
        progress(len(blocks) % chunk)
    n = len(blocks)
    stall = (counts["dram"] * spec.block_bytes / spec.dram_bytes_per_s
             + counts["nvme"] * spec.block_bytes / spec.nvme_bytes_per_s
             + counts["remote"] * spec.block_bytes / spec.remote_bytes_per_s) / n_nodes
    hit = {k: v / n for k, v in counts.items() if k != "miss" and (k != "remote" or remote is not None)}
    out = {"policy": policy, "hbm_blocks": spec.hbm_blocks, "dram_blocks": spec.dram_blocks, "hit": hit,
           "miss": counts["miss"] / n, "stall_s": stall, "accesses_per_s": n / (time.perf_counter() - t0)}
    if n_nodes > 1 or remote is not None:
        out |= {"nodes": n_nodes, "remote_blocks": spec.remote_blocks, "fleet_hit": 1 - counts["miss"] / n,
                "remote_writes": remote.writes if remote is not None else 0}
    return out


__all__ = ["TierSpec", "simulate_tiers"]
