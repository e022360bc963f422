"""Futures over many I/O calls: shared by the real backends and the fault injector."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Optional, Sequence

Failures = list[Optional[BaseException]]  # per read of a pread_many: its error, or None


def gather(futs: Sequence["Future[Any]"]) -> "Future[Failures]":
    """One future over many: done when all are, its result each one's exception or None."""
    out: "Future[Failures]" = Future()
    if not futs:
        out.set_result([])
        return out
    left = [len(futs)]
    lock = threading.Lock()

    def one_done(_: "Future[Any]") -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            out.set_result([f.exception() for f in futs])

    for f in futs:
        f.add_done_callback(one_done)
    return out


__all__ = ["Failures", "gather"]
