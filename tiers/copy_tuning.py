"""Which loop the host copies take, chosen by timing each loop the CPU runs.

The fastest way to stream a large copy through memory depends on the CPU, not the
workload: on a 2-core Intel Xeon host the four-page streaming loop copied 256 MiB over
two threads in 13.9 ms where a plain AVX2 streaming loop took 18.8; on a 2-core AMD EPYC
host, through the mover's own call, the four-page loop took 20.7 ms and a linear sweep
with the source prefetched non-temporally 16.6 ms (one thread of glibc's memcpy: 22). A
fixed choice is wrong on one of them, so the daemon times every loop once, when it builds
its tiers (the first register), on the DRAM pool's own memory (fresh, holding no block),
with the mover's threads and pieces: the very calls the mover makes. The loop is
process-wide state of the copy kernel (``kernels/_copy.c``); the record of how it was
chosen is this module's (``current_choice``), as process-wide.
"""

from __future__ import annotations

import glob
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .hostcopy import HostCopier

try:
    from kvtier.kernels import _copy
except ImportError:  # the compiled copy was not built: numpy's copies, no loop to choose
    _copy = None

MiB = 1 << 20
MIN_BYTES = 32 * MiB  # a copy smaller than this is timed mostly in caches and thread wake-ups
MAX_BYTES = 128 * MiB  # ~8-10 ms a copy: 5 rounds of 3-5 loops take well under a second ...
CACHE_TIMES = 2  # ... unless the last-level cache is larger: copies of twice it then, in fewer rounds
ROUNDS = 5
KEEP_WITHIN = 0.02  # the import-time loop stays unless another is faster by more (noise, not a win)
LOOPS = ("none", "avx2", "avx512", "avx2_linear", "avx512_linear")  # every name the kernel knows
CHOICES = ("auto", *LOOPS)


@dataclass(frozen=True)
class CopyLoopChoice:
    """The loop large host copies take, how it was chosen, and what was measured."""

    loop: str
    how: str  # "measured", "configured", or "default: <why nothing was measured>"
    median_ms: dict[str, float] = field(default_factory=dict)  # per loop timed, one copy of ``copy_bytes``
    copy_bytes: int = 0

    def describe(self) -> str:
        timed = ", ".join(f"{k} {v:.2f} ms" for k, v in self.median_ms.items())
        return f"{self.loop} ({self.how}{f'; {self.copy_bytes >> 20} MiB: {timed}' if timed else ''})"


_choice: Optional[CopyLoopChoice] = None  # the last choice made in this process (``choose_copy_loop``)


def current_choice() -> CopyLoopChoice:
    """The loop large host copies take now and how it was chosen, for every manager of the
    process alike (the loop is the kernel's, not a manager's)."""
    now = current_loop() or "numpy"
    if _choice is not None and _choice.loop == now:
        return _choice
    return CopyLoopChoice(now, "default: not tuned" if _choice is None else "set outside choose_copy_loop")


def runnable_loops() -> list[str]:
    """The loops this CPU runs ([] where the compiled copy was not built)."""
    return [] if _copy is None else list(_copy.streaming_kinds())


def current_loop() -> Optional[str]:
    return None if _copy is None else str(_copy.streaming())


def check_loop(loop: str) -> None:
    """Refuse a configured loop this CPU (or this build) does not run, before anything is built."""
    if loop == "auto":
        return
    if loop not in LOOPS:
        raise ValueError(f"tiers.copy_loop = {loop!r}: not a copy loop (one of {', '.join(CHOICES)})")
    runs = runnable_loops() or ["none"]  # no compiled kernel: numpy's copies, memmove's
    if loop not in runs:
        why = f"this CPU runs {', '.join(runs)}" if _copy is not None else "the compiled copy kernel was not built"
        raise ValueError(f"tiers.copy_loop = {loop!r} cannot run here: {why}")


def _last_level_cache_bytes() -> int:
    """The largest data cache of CPU 0 (sysfs), 0 where unknown."""
    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
            best = max(best, int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return best


def _time_loops(copier: HostCopier, pool: np.ndarray, size: int, loops: list[str], rounds: int) -> dict[str, float]:
    """Median seconds a copy of ``size`` bytes (the pool's first half into its second) per loop,
    after one untimed copy each (the pool's pages are faulted in then). Rounds rotate the order."""
    rows = np.zeros(1, np.int64)
    src, dst = pool[:size].reshape(1, -1), pool[size: 2 * size].reshape(1, -1)
    times: dict[str, list[float]] = {k: [] for k in loops}
    before = _copy.streaming()
    try:
        for r in range(rounds + 1):
            for i in range(len(loops)):
                k = loops[(i + r) % len(loops)]
                _copy.use_streaming(k)
                t0 = time.perf_counter()
                copier.copy_rows(dst, rows, src, rows)
                if r:
                    times[k].append(time.perf_counter() - t0)
    finally:
        _copy.use_streaming(before)
    return {k: statistics.median(v) for k, v in times.items()}


def choose_copy_loop(copier: Optional[HostCopier], pool: Optional[np.ndarray], loop: str = "auto") -> CopyLoopChoice:
    """Set the loop every later large host copy takes and say how it was chosen.

    ``loop`` names one (``check_loop`` first), or ``auto``: each loop the CPU runs is timed on
    ``pool`` (a flat uint8 view of a DRAM pool holding no block: its first half is copied over
    its second, bytes no block owns) and the fastest is taken, unless the loop set at
    import is within ``KEEP_WITHIN`` of it. Nothing is timed where the copies are not the
    compiled kernel's (a CUDA node's go over its copy engine), or the pool is too small to time
    memory rather than caches: the import-time loop stays then, and the choice says why. The
    loop is process-wide: a second manager's choice is every manager's (``current_choice``)."""
    global _choice
    check_loop(loop)
    _choice = _decide(copier, pool, loop)
    return _choice


def _decide(copier: Optional[HostCopier], pool: Optional[np.ndarray], loop: str) -> CopyLoopChoice:
    if loop != "auto":
        if _copy is None:  # "none", the one check_loop lets through: numpy's copies are memmove's
            return CopyLoopChoice("numpy", "configured (none: no compiled kernel, numpy's copies)")
        _copy.use_streaming(loop)
        return CopyLoopChoice(loop, "configured")
    now = current_loop()
    if now is None or copier is None or not copier.compiled:
        return CopyLoopChoice(now or "numpy", "default: no compiled host copy to time")
    if pool is None:
        return CopyLoopChoice(now, "default: no host DRAM pool")
    cache = _last_level_cache_bytes()
    need = max(MIN_BYTES, cache)  # past the caches, or the source is read from them
    size = min(pool.nbytes // 2, max(MAX_BYTES, CACHE_TIMES * cache)) // (4 << 10) * (4 << 10)
    if size < need:
        return CopyLoopChoice(now, f"default: the DRAM pool ({pool.nbytes >> 20} MiB) is too small to time copies "
                                   f"of at least {need >> 20} MiB (past the caches) in its two halves")
    loops = runnable_loops()
    rounds = max(2, min(ROUNDS, ROUNDS * MAX_BYTES // size))  # about the same time for larger copies
    took = _time_loops(copier, pool, size, loops, rounds)
    fastest = min(loops, key=lambda k: took[k])
    chosen = now if took[now] <= took[fastest] * (1 + KEEP_WITHIN) else fastest
    _copy.use_streaming(chosen)
    return CopyLoopChoice(chosen, "measured", {k: round(v * 1e3, 3) for k, v in took.items()}, size)


__all__ = ["CopyLoopChoice", "CHOICES", "LOOPS", "check_loop", "choose_copy_loop", "current_choice", "current_loop",
           "runnable_loops"]
