"""Intrusive doubly linked lists over numpy index arrays.

Every element id in ``[0, capacity)`` has one ``prev``/``next`` entry; a list
is identified by its sentinel, which lives past the element range. Several
lists may share one pair of arrays (an element is in at most one of them at a
time), so several lists over the same elements cost no extra memory per
element. All operations are O(1) except ``pop_front_n`` (O(k) for k popped)
and iteration. No Python objects are allocated per element.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from .key_index import all_distinct

NIL = -1


class IndexLists:
    """``n_lists`` disjoint lists over elements ``0..capacity-1``."""

    def __init__(self, capacity: int, n_lists: int = 1) -> None:
        if capacity < 0 or n_lists < 1:
            raise ValueError("capacity must be >= 0 and n_lists >= 1")
        self.capacity = int(capacity)
        self.n_lists = int(n_lists)
        size = self.capacity + self.n_lists
        self.prev = np.full(size, NIL, dtype=np.int32)
        self.next = np.full(size, NIL, dtype=np.int32)
        # owner[e] = list index holding e, or -1. Lets membership and
        # per-list lengths be O(1) without a scan.
        self.owner = np.full(self.capacity, NIL, dtype=np.int8 if n_lists < 127 else np.int16)
        self.lengths = np.zeros(self.n_lists, dtype=np.int64)
        for lst in range(self.n_lists):
            s = self.sentinel(lst)
            self.prev[s] = s
            self.next[s] = s

    def sentinel(self, lst: int) -> int:
        return self.capacity + lst

    # -- queries ---------------------------------------------------------
    def __len__(self) -> int:
        return int(self.lengths[0])

    def length(self, lst: int = 0) -> int:
        return int(self.lengths[lst])

    def contains(self, elem: int, lst: int = 0) -> bool:
        return int(self.owner[elem]) == lst

    def list_of(self, elem: int) -> int:
        return int(self.owner[elem])

    def front(self, lst: int = 0) -> int:
        s = self.sentinel(lst)
        e = int(self.next[s])
        return NIL if e == s else e

    def back(self, lst: int = 0) -> int:
        s = self.sentinel(lst)
        e = int(self.prev[s])
        return NIL if e == s else e

    def iter(self, lst: int = 0) -> Iterator[int]:
        s = self.sentinel(lst)
        e = int(self.next[s])
        while e != s:
            yield e
            e = int(self.next[e])

    def to_array(self, lst: int = 0) -> np.ndarray:
        return np.fromiter(self.iter(lst), dtype=np.int64, count=self.length(lst))

    # -- mutation --------------------------------------------------------
    def _link_after(self, anchor: int, elem: int, lst: int) -> None:
        if self.owner[elem] != NIL:
            raise ValueError(f"element {elem} is already in list {int(self.owner[elem])}")
        nxt = int(self.next[anchor])
        self.prev[elem] = anchor
        self.next[elem] = nxt
        self.next[anchor] = elem
        self.prev[nxt] = elem
        self.owner[elem] = lst
        self.lengths[lst] += 1

    def push_back(self, elem: int, lst: int = 0) -> None:
        self._link_after(int(self.prev[self.sentinel(lst)]), elem, lst)

    def push_front(self, elem: int, lst: int = 0) -> None:
        self._link_after(self.sentinel(lst), elem, lst)

    def remove(self, elem: int) -> int:
        """Unlink ``elem``; returns the list it was in."""
        lst = int(self.owner[elem])
        if lst == NIL:
            raise ValueError(f"element {elem} is not in any list")
        p = int(self.prev[elem])
        n = int(self.next[elem])
        self.next[p] = n
        self.prev[n] = p
        self.prev[elem] = NIL
        self.next[elem] = NIL
        self.owner[elem] = NIL
        self.lengths[lst] -= 1
        return lst

    def discard(self, elem: int) -> bool:
        if self.owner[elem] == NIL:
            return False
        self.remove(elem)
        return True

    def move_to_back(self, elem: int, lst: int = 0) -> None:
        if self.owner[elem] != NIL:
            self.remove(elem)
        self.push_back(elem, lst)

    def pop_front(self, lst: int = 0) -> int:
        e = self.front(lst)
        if e != NIL:
            self.remove(e)
        return e

    def pop_front_n(self, k: int, lst: int = 0) -> np.ndarray:
        """Pop up to ``k`` elements from the front in one splice."""
        k = min(int(k), self.length(lst))
        out = np.empty(k, dtype=np.int64)
        if k == 0:
            return out
        s = self.sentinel(lst)
        e = int(self.next[s])
        run = np.arange(e, e + k, dtype=np.int64)  # a fresh list holds its elements in id order: check that
        if e + k <= self.capacity and bool((self.next[run[:-1]] == run[1:]).all()):
            out[:] = run
            e = int(self.next[run[-1]])
        else:
            for i in range(k):
                out[i] = e
                e = int(self.next[e])
        # splice the run [out[0] .. out[k-1]] out in O(1) link updates
        self.next[s] = e
        self.prev[e] = s
        self.prev[out] = NIL
        self.next[out] = NIL
        self.owner[out] = NIL
        self.lengths[lst] -= k
        return out

    def extend_back(self, elems: np.ndarray, lst: int = 0, distinct: bool = False) -> None:
        """Append many elements (vectorised link construction). ``distinct``: the caller knows
        ``elems`` repeat none (the sort that checks it was a fifth of a copy's apply)."""
        elems = np.asarray(elems, dtype=np.int64)
        if elems.size == 0:
            return
        if (self.owner[elems] != NIL).any() or not (distinct or all_distinct(elems)):
            raise ValueError("extend_back: some elements are already linked or repeated")
        self.append_unlinked(elems, lst)

    def append_unlinked(self, elems: np.ndarray, lst: int = 0) -> None:
        """``extend_back`` without its checks, for a caller that knows ``elems`` (int64)
        are distinct and in no list: the checks were a third of a batch move's list work."""
        if elems.size == 0:
            return
        s = self.sentinel(lst)
        tail = int(self.prev[s])
        chain = np.concatenate(([tail], elems, [s]))
        self.next[chain[:-1]] = chain[1:]
        self.prev[chain[1:]] = chain[:-1]
        self.owner[elems] = lst
        self.lengths[lst] += elems.size

    def remove_many(self, elems: np.ndarray) -> None:
        """Unlink many elements at once, with the result of removing them one by one.

        Each removed element's nearest surviving neighbours are found by pointer
        doubling over the removed set (sorted, looked up by binary search), so the
        cost is O(k log k) for k elements whatever the list length: no array of
        the list's size is touched unless k is a sixteenth of it or more."""
        elems = np.asarray(elems, dtype=np.int64)
        if elems.size <= 4:  # a Python loop is cheaper than the vector setup
            for e in elems.tolist():
                self.remove(e)
            return
        srt = np.sort(elems)
        if (srt[1:] == srt[:-1]).any() or (self.owner[srt] == NIL).any():
            raise ValueError("remove_many: some elements are repeated or not linked")
        emptied = np.bincount(self.owner[srt].astype(np.int64), minlength=self.n_lists)
        if ((emptied == 0) | (emptied == self.lengths)).all():  # whole lists go (a restart adopting every slot)
            for lst in np.flatnonzero(emptied).tolist():
                s = self.sentinel(lst)
                self.next[s] = self.prev[s] = s
            self.lengths -= emptied
            self.prev[srt] = self.next[srt] = self.owner[srt] = NIL
            return
        last = srt.size - 1
        nxt = self.next[srt].astype(np.int64)
        prv = self.prev[srt].astype(np.int64)
        # where each removed element sits in ``srt``: a binary search per lookup, or, when a
        # large share of the lists goes at once (a restart adopting every NVMe slot), one
        # table of the lists' size, so each doubling round is a gather, not a search
        table = None
        if srt.size * 16 >= self.next.size:
            table = np.full(self.next.size, -1, dtype=np.int64)
            table[srt] = np.arange(srt.size)
        # one unbroken run (a batch that entered a list together leaves it together):
        # exactly one removed element has a surviving prev, and one splice does it
        heads = (table[prv] < 0) if table is not None else (srt[np.minimum(np.searchsorted(srt, prv), last)] != prv)
        if np.count_nonzero(heads) == 1:
            tails = (table[nxt] < 0) if table is not None else (srt[np.minimum(np.searchsorted(srt, nxt), last)] != nxt)
            p, q = int(prv[heads][0]), int(nxt[tails][0])
            self.next[p] = q
            self.prev[q] = p
            self.lengths -= emptied
            self.prev[srt] = self.next[srt] = self.owner[srt] = NIL
            return
        for ptr in (nxt, prv):
            while True:  # jump over removed runs: log2(longest run) rounds
                if table is None:
                    i = np.minimum(np.searchsorted(srt, ptr), last)
                    hit = srt[i] == ptr
                else:
                    i = table[ptr]
                    hit = i >= 0
                if not hit.any():
                    break
                ptr[hit] = ptr[i[hit]]
        self.next[prv] = nxt
        self.prev[nxt] = prv
        self.lengths -= np.bincount(self.owner[srt].astype(np.int64), minlength=self.n_lists)
        self.prev[srt] = NIL
        self.next[srt] = NIL
        self.owner[srt] = NIL

    # -- checking --------------------------------------------------------
    def check(self) -> None:
        """Raise RuntimeError if any list is malformed."""
        seen = np.zeros(self.capacity, dtype=bool)
        for lst in range(self.n_lists):
            s = self.sentinel(lst)
            count = 0
            e = int(self.next[s])
            prev = s
            while e != s:
                if not (0 <= e < self.capacity):
                    raise RuntimeError(f"list {lst}: link to out-of-range element {e}")
                if seen[e]:
                    raise RuntimeError(f"list {lst}: element {e} reached twice")
                if int(self.prev[e]) != prev:
                    raise RuntimeError(f"list {lst}: prev link of {e} broken")
                if int(self.owner[e]) != lst:
                    raise RuntimeError(f"list {lst}: owner of {e} is {int(self.owner[e])}")
                seen[e] = True
                count += 1
                prev = e
                e = int(self.next[e])
            if int(self.prev[s]) != prev:
                raise RuntimeError(f"list {lst}: tail link broken")
            if count != int(self.lengths[lst]):
                raise RuntimeError(f"list {lst}: length {int(self.lengths[lst])} but {count} linked")
        if np.any((self.owner != NIL) & ~seen):
            raise RuntimeError("an element claims membership of a list that does not link it")

    def nbytes(self) -> int:
        return self.prev.nbytes + self.next.nbytes + self.owner.nbytes + self.lengths.nbytes
