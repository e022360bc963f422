"""Pipeline stages drop the saves that a failed KV load on an earlier stage tainted.

A stage computes its KV of a request from the activations every earlier stage sent it, so
a load that failed on stage 0 makes stage 1's KV of that request wrong too, though stage
1's own load succeeded: sealed, it would be served to every later request with that
prefix. Stages cannot agree by a collective where tensor-parallel ranks do
(``tp_taint``): a stage reaches ``wait_for_save`` before it sends the next stage its
activations, so a collective across stages would deadlock, and with speculative decoding
vLLM does not call it on a stage before the last at all.

They share a board instead: one int64 per (stage, tensor-parallel rank) in POSIX shared
memory, which the scheduler creates and names in every step's metadata. A worker writes
its entry the moment it finds a failed load (during its forward, or in ``wait_for_save``:
both before it sends the step's activations on): the last scheduler step whose saves the
failure taints. A later stage reads its predecessors' entries when it saves; the step's
activations reached it after they were written. Steps are the scheduler's numbers, the
same on every stage for the same step, so the workers' own counters need not agree.
One node: stages on another node map a board of their own name and see nothing of this
one's (not closed).
"""

from __future__ import annotations

import logging
import secrets
import time
from multiprocessing import shared_memory
from typing import Optional

import numpy as np

from kvtier.protocol.shm import attach_shm, create_shm, release_shm

ATTACH_WAIT_S = 5.0  # a worker's first step may race the scheduler's creation only by a moment
NO_BOARD = 2**62  # a later stage without a board: every step is tainted

log = logging.getLogger("kvtier.connectors.vllm")


def board_name() -> str:
    """A fresh segment name for one engine's board (unique per scheduler)."""
    return f"kvtier_pp_{secrets.token_hex(8)}"


class StageBoard:
    """The taint entries of every (stage, rank) of one engine. Entry value: 1 + the last
    scheduler step whose saves that worker's failed loads taint (0: none), so a fresh,
    zero-filled segment says "nothing tainted". Each worker writes only its own entry."""

    def __init__(self, name: str, stages: int, ranks: int, create: bool = False) -> None:
        if stages < 1 or ranks < 1:
            raise ValueError(f"a board needs at least one stage and one rank, not {stages} x {ranks}")
        self.name, self.owner = name, create
        nbytes = stages * ranks * 8
        self.shm = create_shm(nbytes, name=name) if create else self._attach(name, nbytes)
        self.entries = np.ndarray((stages, ranks), dtype=np.int64, buffer=self.shm.buf)

    @staticmethod
    def _attach(name: str, nbytes: int) -> shared_memory.SharedMemory:
        deadline = time.monotonic() + ATTACH_WAIT_S
        while True:
            try:
                shm = attach_shm(name)
                if shm.size >= nbytes:
                    return shm
                release_shm(shm, unlink=False)  # created, not yet sized
            except (FileNotFoundError, ValueError):
                pass
            if time.monotonic() >= deadline:
                raise FileNotFoundError(f"pipeline taint board {name!r} ({nbytes} bytes) not found")
            time.sleep(0.005)

    def publish(self, stage: int, rank: int, last_step: int) -> None:
        """Worker (stage, rank) found a failed load tainting saves up to scheduler step ``last_step``."""
        e = self.entries
        e[stage, rank] = max(int(e[stage, rank]), last_step + 1)

    def tainted_until(self, stage: int) -> int:
        """The last scheduler step an earlier stage's failed load taints (-1: none)."""
        return int(self.entries[:stage].max()) - 1 if stage > 0 else -1

    def close(self) -> None:
        """Unmap; the scheduler, which created the board, also removes its name."""
        del self.entries
        release_shm(self.shm, unlink=self.owner)


class StageTaint:
    """One worker's view of its engine's board: (stage, rank), and the board opened at the
    first step whose metadata names it. Without a board (the scheduler could not make one, or
    this worker cannot map it) a stage after the first cannot tell a tainted step from a clean
    one, so it takes every step as tainted and saves nothing."""

    def __init__(self, stage: int, rank: int, stages: int, ranks: int) -> None:
        self.stage, self.rank, self.stages, self.ranks = stage, rank, stages, ranks
        self.board: Optional[StageBoard] = None
        self.named: Optional[str] = ""  # the name last bound ("": none yet), mapped or not

    def bind(self, name: Optional[str]) -> None:
        """The board this step's metadata names (the same every step: mapped once, and a
        name that could not be mapped is not tried again)."""
        if name == self.named:
            return
        self.close()
        self.named = name
        try:
            if name is None:
                raise FileNotFoundError("the scheduler named no pipeline taint board")
            self.board = StageBoard(name, self.stages, self.ranks)
        except OSError as e:
            if self.stage > 0:
                log.warning("kvtier: %s; pipeline stage %d saves nothing", e, self.stage)

    def publish(self, last_step: int) -> None:
        if self.board is not None:
            self.board.publish(self.stage, self.rank, last_step)

    def upstream_until(self) -> int:
        """The last scheduler step an earlier stage's failure taints; every step without a board."""
        if self.stage == 0:
            return -1
        return self.board.tainted_until(self.stage) if self.board is not None else NO_BOARD

    def close(self) -> None:
        if self.board is not None:
            self.board.close()
            self.board = None
        self.named = ""


__all__ = ["StageBoard", "StageTaint", "board_name"]
