"""Delivering the manager's copy events to its listeners (placement, KV events, prefetcher ...).

Each listener takes one block's event; one that also has a batch twin takes a move's
blocks in one call, with the same effect (a test checks the state left is the same):
per-block calls through four Python listeners had cost a third of a 256 KiB copy's time.
While a group of completions is applied, a listener's error is deferred, so the group's
bookkeeping finishes first and no slot leaks; the caller raises the most urgent after."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import numpy as np

log = logging.getLogger("kvtier.tiers")

EventListener = Callable[[str, int, int], None]  # (kind, block, tier)
BatchListener = Callable[[str, np.ndarray, int], None]  # (kind, blocks, tier): one call a move
FailureListener = Callable[[np.ndarray, int], None]  # (blocks a failed move left in tier, tier)


def most_urgent(errors: list[BaseException]) -> Optional[BaseException]:
    """The error to raise of those a group's listeners deferred: an interrupt first."""
    return next((e for e in errors if not isinstance(e, Exception)), errors[0] if errors else None)


@contextmanager
def deferring(owner: Any) -> Iterator[None]:
    """Defer the errors of listeners called through ``owner._deferred`` inside: one that raises
    (even an interrupt) does not cut the bookkeeping short; after it, the first interrupt, else
    the first error, is raised and every other listener error is logged. Nested, the outer one
    collects."""
    if owner._deferred is not None:
        yield
        return
    owner._deferred = []
    raised: Optional[BaseException] = None
    try:
        yield
        raised = most_urgent(owner._deferred)
    finally:
        errors, owner._deferred = owner._deferred, None
        for e in errors:
            if e is not raised:
                log.error("tier event listener failed: %r", e, exc_info=e)
    if raised is not None:
        raise raised


def _call(fn: Callable, deferred: Optional[list[BaseException]], *args: object) -> None:
    if deferred is None:
        fn(*args)
        return
    try:  # applying a group: its bookkeeping finishes first
        fn(*args)
    except BaseException as e:  # an interrupt too: half a group applied would leak its slots
        deferred.append(e)


def emit(listeners: list[EventListener], deferred: Optional[list[BaseException]], kind: str, b: int,
         tier: int) -> None:
    for fn in listeners:
        _call(fn, deferred, kind, b, tier)


def emit_many(listeners: list[EventListener], batch: dict[EventListener, BatchListener],
              deferred: Optional[list[BaseException]], kind: str, blocks: np.ndarray, tier: int) -> None:
    """``emit`` of each of ``blocks``: one call a listener where every listener has a batch twin."""
    if not listeners or not blocks.size:
        return
    if len(batch) < len(listeners):
        for b in blocks.tolist():
            emit(listeners, deferred, kind, b, tier)
        return
    for fn in listeners:
        _call(batch[fn], deferred, kind, blocks, tier)


__all__ = ["EventListener", "BatchListener", "FailureListener", "emit", "emit_many", "most_urgent"]
