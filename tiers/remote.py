"""The remote tier's mover: Redis I/O on worker threads, completions polled by the owner.

The owner loop never waits on the network. A wrong password fails at start
(``RemoteAuthError``); a cluster unreachable at start is a degraded tier like
any later outage, so a Redis outage never keeps a node's own tiers from serving. It submits immutable jobs (a batch
of blocks to publish, or of keys to look up) to a bounded queue and polls
completions without blocking, exactly as it does with the NVMe lane of
``mover.py``: a full queue refuses the job (a publish is skipped, a lookup is a
miss), it never blocks the caller. Source buffers of a publish (a read hold)
and destination slots of a lookup (``busy``) stay reserved by the owner until
the completion is applied.

Faults degrade, they never block an engine: a job that fails (a shard down, a
timeout, a failover in progress) completes as failed, and the tier backs off
(``available`` is False for ``backoff_s``, doubling up to ``backoff_max_s`` while jobs keep
failing), so
lookups are misses the engine recomputes; the first job sent after the failure
that succeeds clears the degraded state (a job sent before it that finishes
late changes nothing: outcomes count in the order jobs were sent).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .backoff import WriteBackoff
from .remote_store import RedisClusterStore, RemoteAuthError, RemoteError


@dataclass(frozen=True)
class RemoteJob:
    tid: int
    kind: str  # "put" or "get"
    blocks: np.ndarray
    tags: np.ndarray  # namespace tag per block
    keys: np.ndarray  # the engines' keys (unscoped)
    buffers: Sequence[np.ndarray]  # put: source bytes; get: destination slot (block_bytes)
    lengths: np.ndarray  # put only
    checksums: np.ndarray  # put only

    def __post_init__(self) -> None:
        for arr in (self.blocks, self.tags, self.keys, self.lengths, self.checksums):
            arr.setflags(write=False)


@dataclass
class RemoteCompletion:
    tid: int
    kind: str
    blocks: np.ndarray
    ok: np.ndarray  # put: stored; get: found and verified
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    checksums: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    corrupt: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""  # the job failed (the store is unreachable) or the cluster refused some of its writes
    refused: bool = False  # the error is the cluster refusing writes (full, read-only): reads still work


class RemoteTier:
    """Worker threads over one ``RedisClusterStore`` each (redis-py clients are not shared)."""

    def __init__(self, connect: Callable[[], RedisClusterStore], workers: int = 2, queue_depth: int = 16,
                 backoff_s: float = 1.0, backoff_max_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._connect = connect
        self.clock = clock
        self.backoff = WriteBackoff(backoff_s, max(backoff_max_s, backoff_s))
        # writes the cluster refuses (full under noeviction, read-only) pause publishing only:
        # reads of what it holds still serve
        self.write_backoff = WriteBackoff(backoff_s, max(backoff_max_s, backoff_s))
        self.last_error = ""
        self.last_refusal = ""
        self.store: Optional[RedisClusterStore] = None
        try:
            self.store = connect()  # a wrong password raises here, at start: a config error
        except RemoteAuthError:
            raise
        except RemoteError as e:  # unreachable now: start degraded (the node's own tiers work), retry later
            self.backoff.failed(clock())
            self.last_error = str(e)
        self._jobs: queue.Queue[Optional[RemoteJob]] = queue.Queue(maxsize=queue_depth)
        self._done: queue.Queue[RemoteCompletion] = queue.Queue()
        self._tids = itertools.count(1)
        # the newest job (by submission) whose outcome set each backoff: with several workers a
        # batch sent before a failure can finish after it, and its success must not clear the
        # failure a newer batch reported (nor an old batch's failure undo a newer success)
        self._latest = {"transport": 0, "writes": 0}
        self.in_flight = 0  # jobs submitted, completion not polled yet (owner side)
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"kvtier-remote-{i}", daemon=True)
                         for i in range(workers)]
        for th in self._threads:
            th.start()

    # -- owner side -------------------------------------------------------------------------
    def available(self) -> bool:
        """Should the owner use the tier now (not backing off after failures)?"""
        return self.backoff.open(self.clock())

    def writable(self) -> bool:
        """Should the owner publish now (available, and not backing off after refused writes)?"""
        return self.available() and self.write_backoff.open(self.clock())

    @property
    def refusing(self) -> bool:
        """The cluster refused our latest writes (we are backing off publishing)."""
        return self.write_backoff.delay_s > 0

    @property
    def degraded(self) -> bool:
        return self.backoff.delay_s > 0

    def submit(self, kind: str, blocks: np.ndarray, tags: np.ndarray, keys: np.ndarray, buffers: Sequence[np.ndarray],
               lengths: Optional[np.ndarray] = None, checksums: Optional[np.ndarray] = None) -> Optional[int]:
        """Queue a job; its id, or None when the queue is full (never blocks)."""
        n = blocks.size
        job = RemoteJob(next(self._tids), kind, blocks.copy(), tags.astype(np.uint64), keys.astype(np.uint64),
                        list(buffers), (lengths if lengths is not None else np.zeros(n, np.int64)).astype(np.int64),
                        (checksums if checksums is not None else np.zeros(n, np.uint64)).astype(np.uint64))
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            return None
        self.in_flight += 1
        return job.tid

    def poll(self, timeout: float = 0.0) -> list[RemoteCompletion]:
        """Completed jobs (waits up to ``timeout`` for the first; the owner loop passes 0)."""
        out: list[RemoteCompletion] = []
        while True:
            try:
                c = self._done.get(timeout=timeout) if timeout > 0 and not out else self._done.get_nowait()
            except queue.Empty:
                break
            self.in_flight -= 1
            now = self.clock()
            if c.refused:  # the cluster answered, refusing: only writes back off (reads' state as it was)
                self.last_refusal = c.error
                if self._newest("writes", c.tid):
                    self.write_backoff.failed(now)
            elif c.error:
                self.last_error = c.error
                if self._newest("transport", c.tid):
                    self.backoff.failed(now)
            else:
                if self._newest("transport", c.tid):
                    self.backoff.succeeded()
                if c.kind == "put" and self._newest("writes", c.tid):
                    self.write_backoff.succeeded()
            out.append(c)
        return out

    def _newest(self, which: str, tid: int) -> bool:
        """Is ``tid`` newer than the job that last set this backoff (then it is now that job)?"""
        if tid < self._latest[which]:
            return False
        self._latest[which] = tid
        return True

    def wait(self, timeout: float = 10.0) -> list[RemoteCompletion]:
        """Poll until nothing is in flight (tests, benchmarks, close)."""
        out: list[RemoteCompletion] = []
        end = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < end:
            out += self.poll(timeout=max(1e-3, end - time.monotonic()))
        return out

    # -- worker side ------------------------------------------------------------------------
    def _run(self, i: int) -> None:
        store: Optional[RedisClusterStore] = self.store if i == 0 else None
        while True:
            job = self._jobs.get()
            if job is None:
                break
            t0 = time.perf_counter()
            try:
                if store is None:
                    store = self._connect()
                c = self._do(store, job)
            except (RemoteError, OSError) as e:
                c = RemoteCompletion(job.tid, job.kind, job.blocks, np.zeros(job.blocks.size, dtype=bool),
                                     error=str(e) or type(e).__name__)
                if isinstance(e, RemoteAuthError):
                    c.error = str(e)
            except Exception as e:  # a bug or an unexpected client error: the job fails, the thread lives
                c = RemoteCompletion(job.tid, job.kind, job.blocks, np.zeros(job.blocks.size, dtype=bool),
                                     error=f"{type(e).__name__}: {e}")
            c.seconds = time.perf_counter() - t0
            self._done.put(c)
        if store is not None and store is not self.store:
            store.close()

    @staticmethod
    def _do(store: RedisClusterStore, job: RemoteJob) -> RemoteCompletion:
        if job.kind == "put":
            ok = store.put_many(job.tags, job.keys, job.buffers, job.lengths, job.checksums)
            # writes the cluster refused (full under noeviction, read-only) fail the job: the tier
            # backs off and says why, instead of the blocks being offered again at once, forever
            return RemoteCompletion(job.tid, "put", job.blocks, ok, nbytes=int(job.lengths[ok].sum()),
                                    error=f"remote tier: {store.refused}" if store.refused else "",
                                    refused=bool(store.refused))
        got = store.get_many(job.tags, job.keys, job.buffers)
        return RemoteCompletion(job.tid, "get", job.blocks, got.found, got.lengths, got.checksums, got.corrupt, got.nbytes)

    def close(self) -> None:
        for _ in self._threads:
            while True:
                try:
                    self._jobs.put(None, timeout=0.1)
                    break
                except queue.Full:
                    if not any(th.is_alive() for th in self._threads):
                        break
        for th in self._threads:
            th.join(timeout=10)
        if self.store is not None:
            self.store.close()


def connect_store(nodes: Sequence[str], **kw: Any) -> Callable[[], RedisClusterStore]:
    """A factory the workers call for their own connection."""
    return lambda: RedisClusterStore(nodes, **kw)


__all__ = ["RemoteTier", "RemoteJob", "RemoteCompletion", "connect_store"]
