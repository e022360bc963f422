"""Futures over many I/O calls: shared by the real backends and the fault injector."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

Failures = list[Optional[BaseException]]  # per read of a pread_many: its error, or None


def gather(futs: Sequence["Future[Any]"]) -> "Future[Failures]":
    """One future over many: done when all are, its result each one's exception or None."""
    out: "Future[Failures]" = Future()
    if not futs:
        out.set_result([])
        return out
    pending = list(futs)
    left = [len(pending)]
    lock = threading.Lock()

    def one_done(_: "Future[Any]") -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            failures = [f.exception() for f in pending]
            # every future's callback list holds this closure, and the closure held every
            # future: a cycle per batch that only a full collection frees (a sawtooth of
            # tens of thousands of objects that fragments the I/O threads' malloc arenas)
            pending.clear()
            out.set_result(failures)

    for f in futs:
        f.add_done_callback(one_done)
    return out


def then_check(fut: "Future[Any]", check: Callable[[], None]) -> "Future[None]":
    """A future that completes once ``fut`` did and ``check()`` then passed (its
    exception, or ``fut``'s, fails it). ``check`` runs where ``fut`` completes,
    on the I/O thread that did the work, or at once if it is already done: a
    read's checksum overlaps the other reads instead of queuing behind them."""
    out: "Future[None]" = Future()

    def done(f: "Future[Any]") -> None:
        exc = f.exception()
        if exc is None:
            try:
                check()
            except Exception as e:  # a failed check fails this job alone
                exc = e
        if exc is None:
            out.set_result(None)
        else:
            out.set_exception(exc)

    fut.add_done_callback(done)
    return out


__all__ = ["Failures", "gather", "then_check"]
