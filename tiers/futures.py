"""Futures over many I/O calls: shared by the real backends and the fault injector."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence, TypeVar

A = TypeVar("A")
B = TypeVar("B")

Failures = list[Optional[BaseException]]  # per read of a pread_many: its error, or None
Write = tuple[Any, Sequence[Any], int]  # (handle, buffers, offset)
# writes that depend on how a batch went (a slot's header goes only where its payload landed):
# called with the batch's failures once it is done, it returns the writes to issue next
Then = Callable[[Failures], Sequence[Write]]


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


def mapped(fut: "Future[A]", fn: Callable[[A], B]) -> "Future[B]":
    """A future of ``fn(fut.result())``, computed where ``fut`` completes (no thread of
    its own); ``fut``'s exception, or ``fn``'s, fails it."""
    out: "Future[B]" = Future()

    def done(f: "Future[A]") -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # the I/O's error or fn's: the caller's to see
            out.set_exception(e)

    fut.add_done_callback(done)
    return out


def followed(first: "Future[Failures]", then: Then,
             issue: Callable[[Sequence[Write]], "Future[Failures]"]) -> "Future[Failures]":
    """``first``'s failures, then those of the writes ``then`` names once it is done,
    issued with ``issue`` (a backend's ``pwrite_many``) from where ``first`` completes:
    it submits and returns, so no I/O thread waits on another's queue."""
    out: "Future[Failures]" = Future()

    def second_done(failures: Failures, g: "Future[Failures]") -> None:
        exc = g.exception()
        if exc is None:
            out.set_result(failures + g.result())
        else:
            out.set_exception(exc)

    def first_done(f: "Future[Failures]") -> None:
        try:
            failures = f.result()
            second = issue(then(failures))
        except BaseException as e:  # the batch failed as a whole, or ``then`` did
            out.set_exception(e)
            return
        second.add_done_callback(lambda g: second_done(failures, g))

    first.add_done_callback(first_done)
    return out


__all__ = ["Failures", "Then", "Write", "followed", "gather", "mapped", "then_check"]
