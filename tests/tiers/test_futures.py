"""The future combinators the I/O backends chain writes with."""

from concurrent.futures import Future

import pytest

from kvtier.tiers.futures import followed, gather, mapped


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
