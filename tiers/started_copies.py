"""Host copies the owner begins as it submits them, finished without a lane worker.

A copy of whole rows between two host pools goes to the copy kernel's own threads
(``HostCopier.start_rows``) the moment it is submitted, and the owner collects it
when it polls: no Python thread has to wake, take the GIL, run the copy and post a
completion. Measured on a 2-core host, each of those hand-offs waited on the
owner's Python (a lane worker gets the GIL only when the owner lets go of it) and
each worker's Python ran on a core the copy wanted: a 256 MiB demotion in four
descriptors took 17-18 ms through the lane against 14.4 ms for the raw copy.

Only the owner thread uses this (submit, poll, drain): the kernel's threads never
touch it. A copy that cannot start here (numpy's copies: strided rows, no
compiled kernel; rows outside a pool) goes to the lane as ever.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Optional

import numpy as np

from .hostcopy import HostCopier
from .paths import ROW_POOLS, CopyEngine, whole_rows
from .transfer import Completion, Transfer


class StartedCopies:
    """Copies in flight on the kernel's threads, oldest first: tid -> (completion, job, start)."""

    def __init__(self, engine: CopyEngine, copier: HostCopier) -> None:
        self._engine = engine
        self._copier = copier
        self._jobs: "OrderedDict[int, tuple[Completion, Any, float]]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._jobs)

    def start(self, t: Transfer) -> bool:
        """Begin ``t`` now if it copies whole rows between host pools; False if the lane must."""
        if not whole_rows(t):
            return False
        dst, src = ROW_POOLS[(t.src, t.dst)](self._engine)
        if dst.host_array is None or src.host_array is None:
            return False
        began = time.perf_counter()  # (before: the caller may copy the first pieces as it starts it)
        try:
            job = self._copier.start_rows(dst.host_array, t.dst_slots, src.host_array, t.src_slots)
        except Exception:  # the lane's path meets it again and fails the transfer's blocks with it
            return False
        if job is None:
            return False
        # its completion made now, while the copy runs: a copy cannot fail a block once started,
        # and numpy's first calls after a large copy (caches cold) were ~70 us of the harvest
        done = Completion(t.tid, t.src, t.dst, t.blocks, np.ones(t.blocks.size, dtype=bool), {}, int(t.lengths.sum()))
        self._jobs[t.tid] = (done, job, began)
        return True

    def harvest(self) -> list[Completion]:
        """Completions of the copies that have landed (joined: their buffers released)."""
        out: list[Completion] = []
        for tid in [tid for tid, (_, job, _) in self._jobs.items() if job.done()]:
            done, job, began = self._jobs.pop(tid)
            job.join()
            done.seconds = time.perf_counter() - began
            out.append(done)
        return out

    def wait(self, timeout: Optional[float]) -> bool:
        """Wait until every copy has landed (None: however long); False if ``timeout`` passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for _, job, _ in list(self._jobs.values()):
            while not job.wait(1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))):
                if deadline is not None and time.monotonic() >= deadline:
                    return False
        return True

    def wait_first(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the oldest copy to land; whether one has."""
        if not self._jobs:
            return False
        _, job, _ = next(iter(self._jobs.values()))
        return bool(job.wait(max(0.0, timeout)))


__all__ = ["StartedCopies"]
