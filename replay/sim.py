"""Cache simulation: the mechanism that drives a policy through a trace.

Strictly causal: an online policy sees one access at a time, in order, and
gets ``next_use = -1``; only offline policies (Belady) receive the future.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from kvtier.policy import make_policy
from kvtier.policy.base import Policy
from kvtier.replay.traces import Trace


class NotResident(RuntimeError):
    """A policy's ``evict`` named a block the cache does not hold: a bug in that policy
    (its hit ratios would count hits on blocks it no longer has)."""

    def __init__(self, policy: str, block: int, where: str = "the cache") -> None:
        super().__init__(f"policy {policy} evicted block {block}, which is not resident in {where} "
                         "(a bug in the policy)")


@dataclass
class RunResult:
    policy: str
    capacity: int
    hits: int
    accesses: int
    seconds: float
    stats: dict = field(default_factory=dict)
    calibration: Optional[dict] = None
    hits_by_part: list[int] = field(default_factory=list)  # hits in each of PARTS equal runs of accesses

    @property
    def hit_ratio_by_part(self) -> list[float]:
        """The hit ratio in each part of the trace, in order: how fast a policy learns (a cold
        start shows as early parts behind a reference that is level with it later)."""
        bounds = part_bounds(self.accesses, len(self.hits_by_part))
        return [h / max(1, hi - lo) for h, lo, hi in zip(self.hits_by_part, bounds[:-1], bounds[1:])]

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def accesses_per_s(self) -> float:
        return self.accesses / self.seconds if self.seconds > 0 else float("inf")


PARTS = 8  # the learning curve: hits per eighth of the trace


def part_bounds(n: int, parts: int) -> list[int]:
    """Access indices that cut ``n`` accesses into ``parts`` runs of (nearly) equal length."""
    return [n * i // parts for i in range(parts + 1)]


def simulate(policy: Policy, trace: Trace, next_use: Optional[np.ndarray] = None,
             progress: Optional[Callable[[int], None]] = None, chunk: int = 20000, compiled: bool = True,
             hits_by_part: Optional[list[int]] = None) -> int:
    """Replay ``trace`` through ``policy`` over one cache; returns hits. Where the policy
    offers a compiled loop (``compiled_replay``) and ``compiled`` is set, runs of
    accesses go through it and the accesses it declines through the hooks below:
    the same decisions either way. ``hits_by_part``, a list of k zeros, gets the hits in
    each of k equal runs of accesses (``part_bounds``)."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1 access, not {chunk}")
    if policy.offline and next_use is None:
        raise ValueError(f"policy {policy.name} is offline: it needs next_use")
    if not getattr(policy, "prepared", True):  # a hindsight reference before its first pass
        raise ValueError(f"policy {policy.name} replays only after prepare(blocks, classes) (run_one calls it)")
    resident = np.zeros(trace.n_unique, dtype=bool)
    if policy.size:  # a policy that already holds blocks: they are resident here too
        held = policy.residents()
        if held is None:
            raise ValueError(f"policy {policy.name} holds {policy.size} blocks it cannot list: replay it from empty")
        resident[held] = True
    # a compiled loop never passes ``next_use``: an offline policy offers one only if it needs none
    make_runner = getattr(policy, "compiled_replay", None) if compiled else None
    runner = make_runner(trace.block, trace.cls, resident) if make_runner is not None else None
    blocks = trace.block.tolist()
    times = trace.time_s.tolist()
    classes = trace.cls.tolist()
    nxt = next_use.tolist() if policy.offline and next_use is not None else None
    cap = policy.capacity
    n_blocks = trace.n_unique
    hits = 0
    observe, on_hit, admit, evict, insert = policy.observe, policy.on_hit, policy.admit, policy.evict, policy.insert

    def step(i: int) -> int:
        """Access ``i`` through the policy's hooks: 1 on a hit."""
        b, now, c = blocks[i], times[i], classes[i]
        nu = nxt[i] if nxt is not None else -1
        observe(b, now, c)
        if resident[b]:
            on_hit(b, now, c, nu)
            return 1
        if admit(b, now, c, nu):
            if policy.size >= cap:
                v = evict(now)
                if not (0 <= v < n_blocks and resident[v]):
                    raise NotResident(policy.name, v)
                resident[v] = False
            insert(b, now, c, nu)
            resident[b] = True
        return 0

    n = len(blocks)
    cuts = part_bounds(n, len(hits_by_part)) if hits_by_part else [0, n]
    # chunks never straddle a part's end, so each chunk's hits belong to one part
    stops = sorted({*range(chunk, n, chunk), *cuts[1:]})
    start = 0
    for stop in stops:
        if stop <= start:
            continue
        before = hits
        if runner is None:
            for i in range(start, stop):
                hits += step(i)
        else:
            i = start
            while i < stop:
                i, h = runner(i, stop)
                hits += h
                if i < stop:
                    hits += step(i)
                    i += 1
        if hits_by_part:
            hits_by_part[bisect.bisect_left(cuts, stop) - 1] += hits - before
        if progress is not None:
            progress(stop - start)
        start = stop
    return hits


def run_one(name: str, capacity: int, trace: Trace, next_use: Optional[np.ndarray],
            params: dict[str, Any], progress: Optional[Callable[[int], None]] = None) -> RunResult:
    policy = make_policy(name, capacity, trace.n_unique, **params.get(name, {}))
    t0 = time.perf_counter()  # a hindsight reference's first pass over the trace is part of its cost
    prepare = getattr(policy, "prepare", None)
    if prepare is not None:
        prepare(trace.block, trace.cls, progress)
    parts = [0] * PARTS
    hits = simulate(policy, trace, next_use, progress, hits_by_part=parts)
    seconds = time.perf_counter() - t0
    return RunResult(name, capacity, hits, trace.n_accesses, seconds, policy.stats(), policy.calibration(), parts)
