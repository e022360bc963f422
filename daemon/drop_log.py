"""Which block ids an engine's recent requests let go of, so late telemetry cannot credit them.

Telemetry travels on its own PUSH socket, apart from the RPCs. A report the engine built
before it freed a block (or sealed it into a shared one) can be read after the free, when
the id may already name another block, the engine's own next alloc included. Each report
carries the id of the last request the client had sent when it built it (its stamp);
the daemon keeps, per engine, the ids that requests after that stamp dropped, and the
report does not touch them. The log is kept for ``keep_s`` seconds and ``max_entries``
requests; a report stamped before what the log still covers is dropped whole, since
what it may name can no longer be told apart.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np


class DropLog:
    """Recent requests of one engine session that dropped references: (request id, ids, time)."""

    def __init__(self, start_rid: int, keep_s: float = 10.0, max_entries: int = 1024) -> None:
        self.horizon = int(start_rid)  # stamps below this are older than the log covers
        self.keep_s = keep_s
        self.max_entries = max_entries
        self._entries: deque[tuple[int, np.ndarray, float]] = deque()

    def note(self, rid: int, ids: np.ndarray, now: float) -> None:
        """Request ``rid`` dropped references to ``ids`` (some may still be held: shared blocks)."""
        if ids.size:
            self._entries.append((int(rid), np.array(ids, dtype=np.int64), now))
        while self._entries and (len(self._entries) > self.max_entries or now - self._entries[0][2] > self.keep_s):
            self.horizon = max(self.horizon, self._entries.popleft()[0])

    def skip(self, stamp: int, blocks: np.ndarray) -> Optional[np.ndarray]:
        """Which of a report's ``blocks`` it must not touch (a mask), or None for all of them:
        those dropped by requests sent after the report was built (ids above ``stamp``)."""
        if stamp < self.horizon:
            return None
        later = []
        for rid, ids, _ in reversed(self._entries):  # newest first: one connection keeps requests in order
            if rid <= stamp:
                break
            later.append(ids)
        if not later:
            return np.zeros(blocks.size, dtype=bool)
        return np.isin(blocks, np.concatenate(later))


__all__ = ["DropLog"]
