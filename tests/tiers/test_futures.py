"""The future combinators the I/O backends chain writes with."""

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from kvtier.tiers.futures import followed, gather, mapped
from kvtier.tiers.types import TierError


def _done(value=None, exc=None) -> Future:
    f: Future = Future()
    if exc is not None:
        f.set_exception(exc)
    else:
        f.set_result(value)
    return f


def test_mapped_applies_fn_where_the_future_completes_and_passes_errors_on():
    pending: Future = Future()
    out = mapped(pending, lambda xs: [x * 2 for x in xs])
    assert not out.done()
    pending.set_result([1, 2])
    assert out.result(timeout=1) == [2, 4]
    assert isinstance(mapped(_done(exc=OSError(5, "EIO")), len).exception(timeout=1), OSError)
    assert isinstance(mapped(_done([1]), lambda _: 1 / 0).exception(timeout=1), ZeroDivisionError)


def test_followed_issues_the_second_writes_from_the_first_batchs_failures():
    issued = []

    def issue(writes):
        issued.append(list(writes))
        return gather([_done(exc=OSError(28, "ENOSPC")) if w == "bad" else _done(1) for w in writes])

    first: Future = Future()
    out = followed(first, lambda failures: ["ok" if f is None else "skip" for f in failures][:1] + ["bad"], issue)
    assert issued == [] and not out.done()  # nothing issued before the first batch is done
    err = OSError(5, "EIO")
    first.set_result([None, err])
    failures = out.result(timeout=1)
    assert issued == [["ok", "bad"]]
    assert failures[:2] == [None, err] and failures[2] is None and isinstance(failures[3], OSError)


@pytest.mark.parametrize("where", ["first", "then", "issue", "second"])
def test_followed_fails_as_a_whole_wherever_it_breaks(where):
    """No future is left unresolved: a batch that failed as a whole, a ``then`` or an
    ``issue`` that raised, or a second batch that failed as a whole fails the result."""
    boom = RuntimeError(where)

    def then(failures):
        if where == "then":
            raise boom
        return ["w"]

    def issue(writes):
        if where == "issue":
            raise boom
        return _done(exc=boom) if where == "second" else _done([None])

    first = _done(exc=boom) if where == "first" else _done([None])
    assert followed(first, then, issue).exception(timeout=1) is boom


class _Part:
    """A kvikio IOFuture stand-in (``get()`` blocks until the part is done): injects a
    failed part beside one still in flight, which needs no CUDA to happen."""

    def __init__(self, nbytes: int = 0, exc: Exception | None = None, in_flight: bool = False) -> None:
        self.nbytes, self.exc, self.finished = nbytes, exc, threading.Event()
        if not in_flight:
            self.finished.set()

    def get(self) -> int:
        self.finished.wait(5)
        if self.exc is not None:
            raise self.exc
        return self.nbytes


def test_a_kvikio_io_with_a_failed_part_is_done_only_when_every_part_is():
    """The failure releases the block's slot, so no part of it may still be landing there."""
    from kvtier.tiers.io_kvikio import _Joined

    pool = ThreadPoolExecutor(1)
    try:
        failed, landing = _Part(exc=RuntimeError("cuFile EIO")), _Part(4096, in_flight=True)
        joined = _Joined([failed, landing], pool, 8192)
        time.sleep(0.05)
        assert not joined.done()  # the first part failed; the second is still writing
        landing.finished.set()
        exc = joined.exception(timeout=5)
        assert isinstance(exc, TierError) and "cuFile EIO" in str(exc)
        whole = _Joined([_Part(4096), _Part(4096)], pool, 8192)
        assert whole.result(timeout=5) == 8192
        assert isinstance(_Joined([_Part(4096)], pool, 8192).exception(timeout=5), TierError)  # short
    finally:
        pool.shutdown()
