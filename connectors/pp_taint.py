"""Pipeline stages drop the saves that a failed KV load on an earlier stage tainted.

A stage computes its KV of a request from the activations every earlier stage sent it, so
a load that failed on stage 0 makes stage 1's KV of that request wrong too, though stage
1's own load succeeded: sealed, it would be served to every later request with that
prefix. Stages cannot agree by a collective where tensor-parallel ranks do
(``tp_taint``): a stage reaches ``wait_for_save`` before it sends the next stage its
activations, so a collective across stages would deadlock, and with speculative decoding
vLLM does not call it on a stage before the last at all.

They share a board instead: per (stage, tensor-parallel rank) an int64 in POSIX shared
memory, which the scheduler creates and names in every step's metadata. A worker marks its
entry when it maps the board, and writes it the moment it finds a failed load in its
forward (before it sends the step's activations on): the last scheduler step whose saves
the failure taints. A later stage reads its predecessors' entries when it saves; the
step's activations reached it after they were written. Steps are the scheduler's numbers,
the same on every stage for the same step, so the workers' own counters need not agree.
An earlier stage that never marked its entry (it could not map the board) taints every
step. Workers map the board with a plain ``mmap`` of its ``/dev/shm`` file: vLLM's
workers share the scheduler process's resource tracker, and ``SharedMemory``'s
register-then-unregister on attach would delete the scheduler's own entry (its board would
then leak when it dies). A stage on another node cannot map it, and saves nothing.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import time
from typing import Optional

import numpy as np

from kvtier.protocol.shm import SHM_DIR, create_shm, release_shm, segment_prefix

ATTACH_WAIT_S = 5.0  # a worker's first step may race the scheduler's creation only by a moment
NO_BOARD = 2**62  # an upstream worker without a board: every step is tainted

log = logging.getLogger("kvtier.connectors.vllm")


def board_name() -> str:
    """A fresh segment name for one engine's board, prefixed with its creator's pid."""
    return f"{segment_prefix(os.getpid())}pp_{secrets.token_hex(6)}"


class StageBoard:
    """Every (stage, rank) worker's entries of one engine. Row 0: 1 + the last scheduler step
    whose saves that worker's failed loads taint (0: none); row 1: 1 once the worker mapped
    the board. A fresh, zero-filled segment says "nothing tainted, nobody here yet". Each
    worker writes only its own entries."""

    def __init__(self, name: str, stages: int, ranks: int, create: bool = False) -> None:
        if stages < 1 or ranks < 1:
            raise ValueError(f"a board needs at least one stage and one rank, not {stages} x {ranks}")
        self.name, self.owner = name, create
        nbytes = 2 * stages * ranks * 8
        self.shm = create_shm(nbytes, name=name) if create else None
        self.map = self.shm.buf if self.shm is not None else self._attach(name, nbytes)
        cells = np.ndarray((2, stages, ranks), dtype=np.int64, buffer=self.map)
        self.taint, self.attached = cells[0], cells[1]

    @staticmethod
    def _attach(name: str, nbytes: int) -> mmap.mmap:
        path = os.path.join(SHM_DIR, name)
        deadline = time.monotonic() + ATTACH_WAIT_S
        while True:
            try:
                fd = os.open(path, os.O_RDWR)
                try:
                    if os.fstat(fd).st_size >= nbytes:  # not while its creator is still sizing it
                        return mmap.mmap(fd, nbytes)
                finally:
                    os.close(fd)
            except FileNotFoundError:
                pass
            if time.monotonic() >= deadline:
                raise FileNotFoundError(f"pipeline taint board {path} ({nbytes} bytes) not found")
            time.sleep(0.005)

    def mark(self, stage: int, rank: int) -> None:
        """Worker (stage, rank) has the board: its silence now means no failure."""
        self.attached[stage, rank] = 1

    def publish(self, stage: int, rank: int, last_step: int) -> None:
        """Worker (stage, rank) found a failed load tainting saves up to scheduler step ``last_step``."""
        t = self.taint
        t[stage, rank] = max(int(t[stage, rank]), last_step + 1)

    def tainted_until(self, stage: int) -> int:
        """The last scheduler step an earlier stage's failed load taints (-1: none); every
        step while an earlier stage's worker has not marked the board."""
        if stage <= 0:
            return -1
        if not bool(self.attached[:stage].all()):
            return NO_BOARD
        return int(self.taint[:stage].max()) - 1

    def close(self) -> None:
        """Unmap; the scheduler, which created the board, also removes its name."""
        del self.taint, self.attached
        if self.shm is not None:
            release_shm(self.shm, unlink=self.owner)
        else:
            try:
                self.map.close()  # type: ignore[union-attr]  # an mmap where there is no shm
            except BufferError:
                pass  # a view still held elsewhere keeps the mapping until it is collected


class StageTaint:
    """One worker's view of its engine's board: (stage, rank), and the board mapped at the
    first step whose metadata names it. Without a board (the scheduler could not make one, or
    this worker cannot map it) a stage after the first cannot tell a tainted step from a clean
    one, so it takes every step as tainted and saves nothing; the first stage never marks it,
    so the later stages that have it do the same."""

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
            self.board.mark(self.stage, self.rank)
        except (OSError, ValueError) as e:
            log.warning("kvtier: pipeline stage %d has no taint board (%s): %s save nothing", self.stage, e,
                        "it and the stages after it" if self.stage else "the stages after it")

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


__all__ = ["NO_BOARD", "StageBoard", "StageTaint", "board_name"]
