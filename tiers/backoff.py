"""Backing off a disk whose writes fail.

A failed NVMe write-back leaves the block where it was, so placement would
choose it again on its next turn and hit the same failing disk every loop
iteration. After a failed write batch NVMe is closed as a destination for
``base_s`` seconds, doubling (up to ``max_s``) while writes keep failing, and
reset by the first batch that fully succeeds. Reads are not affected: a disk
that refuses writes may still serve what it holds.
"""

from __future__ import annotations


class WriteBackoff:
    def __init__(self, base_s: float = 1.0, max_s: float = 30.0) -> None:
        if base_s < 0 or max_s < base_s:
            raise ValueError("need 0 <= base_s <= max_s")
        self.base_s = float(base_s)
        self.max_s = float(max_s)
        self.delay_s = 0.0  # the current window's length; 0 while writes succeed
        self.until = float("-inf")

    def failed(self, now: float) -> None:
        """A write batch failed at ``now``: close the destination for the next window."""
        self.delay_s = self.base_s if self.delay_s == 0 else min(self.max_s, 2 * self.delay_s)
        self.until = now + self.delay_s

    def succeeded(self) -> None:
        self.delay_s = 0.0
        self.until = float("-inf")

    def open(self, now: float) -> bool:
        """May writes be sent now?"""
        return now >= self.until
