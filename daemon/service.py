"""The daemon's state machine: RPC operations over one TierManager.

Socket-free, so it is tested directly and driven by ``server.py``'s owner
loop, the only thread that calls it. Every op validates fully before it
changes anything; misuse raises ``ProtocolError`` (an error reply) and leaves
state unchanged. The tier manager is built by the first ``register``: only
then is the block size known (and, when the engine brings its own HBM region,
where HBM is).
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter
from multiprocessing import shared_memory
from typing import Any, Callable, Optional

import numpy as np
import torch

from kvtier.scoring.importance import ImportanceScores
from kvtier.tiers.manager import TierManager
from kvtier.tiers.pools import attach_shm, release_shm, round_up
from kvtier.tiers.types import FREE, HBM, OPEN

from kvtier.protocol import wire as P
from .acquire import AllocWaiter, Prefetcher, Waiter, speculate
from .config import KvtierConfig
from .events import EventCollector
from .placement import Placement
from kvtier.protocol.wire import ProtocolError
from .residency import STALL_BUCKETS, ResidencyOps
from .session import EngineSession
from .telemetry import ingest

log = logging.getLogger("kvtier.service")


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # remote or unknown: heartbeats alone decide
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Service(ResidencyOps):
    def __init__(self, cfg: KvtierConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.mgr: Optional[TierManager] = None
        self.placement: Optional[Placement] = None
        self.scores: Optional[ImportanceScores] = None
        self.events: Optional[EventCollector] = None
        self.prefetcher: Optional[Prefetcher] = None
        self.engines: dict[str, EngineSession] = {}
        self.waiters: dict[int, Waiter] = {}
        self.alloc_waiters: list[AllocWaiter] = []
        self.tickets = itertools.count(1)
        self.counters: Counter[str] = Counter()
        self.block_tokens = 16
        self.layers = 1  # parts a DRAM -> HBM promotion is copied and reported in (the engine's layers)
        self.stall_counts = np.zeros(len(STALL_BUCKETS) + 1, dtype=np.int64)  # histogram (last: +Inf)
        self.stall_sum = 0.0
        self._hbm_shm: Optional[shared_memory.SharedMemory] = None
        self._hbm_handle = b""  # CUDA IPC handle of a daemon-allocated device pool, for engines to map
        self.ops: dict[str, Callable[[EngineSession | None, Any], Any]] = {
            "ping": self.op_ping, "heartbeat": self.op_ping, "stats": self.op_stats, "register": self.op_register,
            "unregister": self.op_unregister, "alloc": self.op_alloc, "seal": self.op_seal, "ref": self.op_ref,
            "acquire": self.op_acquire, "acquire_poll": self.op_acquire_poll, "release": self.op_release,
            "free": self.op_free, "hint": self.op_hint, "clear": self.op_clear, "check": self.op_check,
        }

    # -- dispatch --------------------------------------------------------------
    def handle(self, req: P.Request, args: Any) -> Any:
        """Run one validated request: a result dict, or a ``Waiter`` to answer later."""
        session = None
        if req.op not in P.NO_ENGINE_OPS:
            session = self.engines.get(req.engine)
            if session is None:
                raise ProtocolError(P.UNKNOWN_ENGINE, f"engine {req.engine!r} is not registered")
            session.last_seen = self.clock()
        elif req.op == "register":
            return self.op_register(req.engine, args)
        try:
            return self.ops[req.op](session, args)
        except ValueError as e:
            raise ProtocolError(P.INVALID, str(e)) from None

    def _need_mgr(self) -> TierManager:
        if self.mgr is None:
            raise ProtocolError(P.INVALID, "no engine has registered yet: the block size is unknown")
        return self.mgr

    def _ids(self, value: Any, what: str, dtype: type = np.int64) -> np.ndarray:
        return P.ids(value, dtype, self.cfg.server.max_batch_blocks, what)

    def _blocks(self, session: EngineSession, args: Any, allow_keys: bool = True) -> np.ndarray:
        """Resolve blocks / keys / seqs of a request to unique live block ids."""
        mgr = self._need_mgr()
        parts = [self._ids(getattr(args, "blocks", None), "blocks")]
        if allow_keys and getattr(args, "keys", None) is not None:
            keys = self._ids(args.keys, "keys", np.uint64)
            found = mgr.table.keys.get_many(keys)
            if np.any(found < 0):
                raise ProtocolError(P.INVALID, f"unknown key {int(keys[np.argmax(found < 0)]):#x}")
            parts.append(found.astype(np.int64))
        if getattr(args, "seqs", None):
            parts.append(session.seq_blocks(args.seqs))
        if len(parts) > 1:
            return mgr._check_blocks(np.unique(np.concatenate(parts)))  # overlapping sources: sorted union
        return mgr._check_blocks(parts[0])  # one source: the caller's order, so replies line up with it

    # -- engines -----------------------------------------------------------------
    def op_ping(self, session: Optional[EngineSession], args: Any) -> dict:
        from kvtier import __version__

        return {"pong": True, "version": __version__, "protocol": P.VERSION, "time": time.time()}

    def op_stats(self, session: Optional[EngineSession], args: Any) -> dict:
        from .stats import snapshot  # stats reads the service: imported late, not at module load

        return snapshot(self)

    def _build_manager(self, args: Any) -> None:
        tc = self.cfg.tiers
        stride = round_up(args.block_bytes)
        hbm_tensor = None
        if args.hbm_kind == "shm":
            if not args.hbm_name or args.hbm_slots <= 0:
                raise ProtocolError(P.BAD_REQUEST, "hbm_kind 'shm' needs hbm_name and hbm_slots")
            try:
                shm = attach_shm(args.hbm_name)
            except (FileNotFoundError, ValueError, OSError) as e:
                raise ProtocolError(P.INVALID, f"cannot map HBM region {args.hbm_name!r}: {e}") from None
            if shm.size < args.hbm_slots * stride:
                release_shm(shm, unlink=False)
                raise ProtocolError(P.INVALID, f"HBM region has {shm.size} bytes, need {args.hbm_slots * stride}")
            self._hbm_shm = shm
            hbm_tensor = torch.frombuffer(shm.buf, dtype=torch.uint8, count=args.hbm_slots * stride)
            hbm_slots = args.hbm_slots
        elif args.hbm_kind == "cuda_ipc":
            hbm_tensor, hbm_slots = self._open_cuda_ipc(args, stride)
        else:
            hbm_slots = tc.hbm_bytes // stride
        dram_slots, nvme_slots = tc.dram_bytes // stride, tc.nvme_bytes // stride
        if tc.nvme_bytes:
            os.makedirs(tc.nvme_dir, mode=0o700, exist_ok=True)
        total = hbm_slots + dram_slots + nvme_slots
        self.mgr = TierManager(
            args.block_bytes, hbm_slots, dram_slots, nvme_slots, nvme_dir=tc.nvme_dir if nvme_slots else None,
            max_blocks=tc.max_blocks or max(1, total), io_backend=tc.io_backend, io_threads=tc.io_threads,
            mover_workers=tc.mover_workers, hbm_tensor=hbm_tensor, dram_numa_node=tc.dram_numa_node,
            recover_payloads=tc.recovery_verify == "payload", clock=self.clock)
        if self.mgr.nvme is not None:
            log.info("NVMe tier: %d cached blocks recovered (%s, %d slots discarded)", self.mgr.recovered,
                     self.mgr.recovered_from or "nothing to recover", self.mgr.discarded)
        if hbm_tensor is None and self.mgr.hbm.is_cuda:
            from kvtier.protocol.cuda_ipc import export_handle

            self._hbm_handle = export_handle(self.mgr.hbm.tensor)
        self.block_tokens = args.block_tokens
        layers = args.layout.get("layers", 1)
        self.layers = layers if isinstance(layers, int) and layers > 0 and args.block_bytes % layers == 0 else 1
        pc = self.cfg.policy
        pr = self.cfg.predictor
        params = pc.params() | {"track_calibration": pr.track_calibration, "calibration_bins": pr.calibration_bins,
                                "calibration_sample": pr.calibration_sample, "calibration_window": 1 << 17}
        self.placement = Placement(self.mgr, pc.name, params, self.clock)
        sc = self.cfg.scoring
        self.scores = ImportanceScores(self.mgr.table.max_blocks, **sc.model_dump())
        self.events = EventCollector(self.mgr, self.block_tokens)
        self.prefetcher = Prefetcher(pc.prefetch_budget_bytes_per_s, args.block_bytes, self.mgr.table.max_blocks)
        self.mgr.listeners.append(self.prefetcher.on_event)

    def _open_cuda_ipc(self, args: Any, stride: int) -> tuple[torch.Tensor, int]:
        if not torch.cuda.is_available():
            raise ProtocolError(P.INVALID, "hbm_kind 'cuda_ipc' needs CUDA in the daemon")
        if not args.hbm_handle or args.hbm_slots <= 0:
            raise ProtocolError(P.BAD_REQUEST, "hbm_kind 'cuda_ipc' needs hbm_handle and hbm_slots")
        from kvtier.protocol.cuda_ipc import import_handle

        try:
            tensor = import_handle(args.hbm_handle)
        except Exception as e:  # a malformed or stale handle must not kill the daemon
            raise ProtocolError(P.INVALID, f"bad CUDA IPC handle: {e}") from None
        if not isinstance(tensor, torch.Tensor) or tensor.numel() * tensor.element_size() < args.hbm_slots * stride:
            raise ProtocolError(P.INVALID, "CUDA IPC region is too small")
        return tensor, args.hbm_slots

    def hbm_info(self) -> dict:
        mgr = self._need_mgr()
        return {"hbm_kind": "cuda" if mgr.hbm.is_cuda else "shm", "hbm_name": mgr.hbm.shm_name or "",
                "hbm_handle": self._hbm_handle, "hbm_slots": mgr.table.slots_per_tier[HBM],
                "slot_stride": mgr.hbm.slot_stride, "block_bytes": mgr.block_bytes}

    def op_register(self, engine_id: str, args: Any) -> dict:
        if not engine_id:
            raise ProtocolError(P.BAD_REQUEST, "register needs a non-empty engine id")
        if self.mgr is None:
            self._build_manager(args)
        else:
            if args.block_bytes != self.mgr.block_bytes:
                raise ProtocolError(P.CONFLICT, f"block_bytes {args.block_bytes} differs from the daemon's "
                                                f"{self.mgr.block_bytes} (set by the first engine)")
            if args.hbm_kind == "shm" and args.hbm_name != (self.mgr.hbm.shm_name or (
                    self._hbm_shm.name if self._hbm_shm else None)):
                raise ProtocolError(P.CONFLICT, "the daemon already manages another HBM region")
        if engine_id in self.engines:  # a restarted engine: its old holdings are void
            self.reclaim(engine_id, "re-registered")
        self.engines[engine_id] = EngineSession(engine_id, args.pid, args.block_tokens, dict(args.layout),
                                                self.clock(), self.mgr.table.max_blocks)  # type: ignore[union-attr]
        self.counters["registers"] += 1
        info = self.hbm_info()
        if self._hbm_shm is not None:
            info["hbm_name"] = self._hbm_shm.name
        return info | {"heartbeat_timeout_s": self.cfg.server.heartbeat_timeout_s}

    def op_unregister(self, session: EngineSession, args: Any) -> dict:
        return {"reclaimed": self.reclaim(session.engine_id, "unregistered")}

    def reclaim(self, engine_id: str, why: str) -> int:
        """Drop an engine's pins, waiters and references; other engines are untouched."""
        session = self.engines.pop(engine_id, None)
        if session is None or self.mgr is None:
            return 0
        mgr, t = self.mgr, self.mgr.table
        for tk in [k for k, w in self.waiters.items() if w.session is session]:
            self.waiters.pop(tk)
        held = np.flatnonzero(session.pins)
        while held.size:  # unpin through the manager, so blocks that die on release are reaped
            mgr.unpin_many(held)
            session.pins[held] -= 1
            held = held[session.pins[held] > 0]
        n_blocks = 0
        for b, n in session.refs.items():
            for _ in range(n):
                mgr.free(b, allow_pinned=True)  # another engine may hold a shared block pinned
            n_blocks += 1
        self.counters[f"reclaimed_{why.replace('-', '_')}"] += 1
        return n_blocks

    def check_engines(self) -> list[str]:
        """Reclaim engines whose heartbeat timed out or whose process died."""
        now = self.clock()
        gone = []
        for eid, s in list(self.engines.items()):
            if now - s.last_seen > self.cfg.server.heartbeat_timeout_s:
                self.reclaim(eid, "timeout")
                gone.append(eid)
            elif not _pid_alive(s.pid):
                self.reclaim(eid, "process-died")
                gone.append(eid)
        return gone

    # -- block lifecycle -------------------------------------------------------------
    def op_alloc(self, session: EngineSession, args: Any) -> Any:
        mgr = self._need_mgr()
        if args.n > self.cfg.server.max_batch_blocks:
            raise ProtocolError(P.TOO_LARGE, f"alloc of {args.n} exceeds {self.cfg.server.max_batch_blocks}")
        if args.n > mgr.table.slots_per_tier[HBM]:
            raise ProtocolError(P.NO_SPACE, f"{args.n} blocks can never fit {mgr.table.slots_per_tier[HBM]} HBM slots")
        result = self._try_alloc(session, args)
        if result is not None:
            return result
        if not args.wait:
            raise ProtocolError(P.NO_SPACE, f"no room for {args.n} blocks in HBM yet; demotions are in flight, retry")
        timeout = args.timeout_s if args.timeout_s is not None else self.cfg.server.acquire_timeout_s
        w = AllocWaiter(session, args, self.clock() + timeout)
        self.alloc_waiters.append(w)
        return w

    def _try_alloc(self, session: EngineSession, args: Any) -> Optional[dict]:
        mgr = self.mgr
        assert mgr is not None
        blocks = mgr.alloc(args.n)
        if blocks is None:
            self.placement.make_room(HBM, args.n, urgent=True)  # type: ignore[union-attr]
            blocks = mgr.alloc(args.n)
        if blocks is None:
            return None
        mgr.table.nbytes[blocks] = mgr.block_bytes  # the engine writes the slot directly: all of it is payload
        session.add_refs(blocks, args.seq)
        if args.pin:  # the engine writes them next: keep them in HBM until it releases them
            mgr.pin_many(blocks, checked=True)
            session.pins[blocks] += 1
        self.placement.on_alloc(blocks, continues=bool(args.seq is not None and args.seq in session.seqs  # type: ignore[union-attr]
                                                            and len(session.seqs[args.seq]) > blocks.size))
        self.counters["allocs"] += int(blocks.size)
        return {"blocks": P.id_bytes(blocks), "slots": P.id_bytes(mgr.table.slot[HBM, blocks])}

    def advance_allocs(self) -> list[tuple[AllocWaiter, Any]]:
        """Retry waiting allocs in arrival order: (waiter, result or ProtocolError) for each finished."""
        out: list[tuple[AllocWaiter, Any]] = []
        now = self.clock()
        keep = []
        for w in self.alloc_waiters:
            if w.session.engine_id not in self.engines:
                continue  # its engine was reclaimed: nobody to answer
            result = self._try_alloc(w.session, w.args)
            if result is not None:
                out.append((w, result))
            elif now > w.deadline:
                self.counters["alloc_timeouts"] += 1
                out.append((w, ProtocolError(P.NO_SPACE, f"no room for {w.args.n} blocks in HBM before the deadline")))
            else:
                keep.append(w)
        self.alloc_waiters = keep
        return out

    def op_seal(self, session: EngineSession, args: Any) -> dict:
        mgr = self._need_mgr()
        t = mgr.table
        blocks = self._ids(args.blocks, "blocks")
        keys = self._ids(args.keys, "keys", np.uint64)
        if blocks.size != keys.size:
            raise ProtocolError(P.BAD_REQUEST, f"{blocks.size} blocks but {keys.size} keys")
        if np.unique(blocks).size != blocks.size:
            raise ProtocolError(P.INVALID, "a block is named twice in one request")
        if args.nbytes is not None and args.nbytes > mgr.block_bytes:
            raise ProtocolError(P.INVALID, f"nbytes {args.nbytes} exceeds the block size {mgr.block_bytes}")
        for b in blocks.tolist():  # validate all before sealing any
            if session.refs.get(b, 0) <= 0:
                raise ProtocolError(P.INVALID, f"block {b} is not held by engine {session.engine_id!r}")
            if t.state[b] != OPEN:
                raise ProtocolError(P.INVALID, f"block {b} is already sealed")
            if not t.has_copy(b, HBM) or t.busy[b]:
                raise ProtocolError(P.INVALID, f"block {b} must be resident in HBM and idle to seal")
            if t.pins[b] != session.pins[b]:
                raise ProtocolError(P.INVALID, f"block {b} is pinned by another engine")
        out = np.empty_like(blocks)
        nbytes = args.nbytes if args.nbytes is not None else mgr.block_bytes
        cont = args.seq is not None and args.seq in session.seqs and len(session.seqs[args.seq]) > blocks.size
        for i, (b, k) in enumerate(zip(blocks.tolist(), keys.tolist())):
            if session.pins[b] and t.lookup(k) >= 0:  # folding into a shared block: our pins on b go
                while session.pins[b]:
                    mgr.unpin_many(np.array([b]), checked=True)
                    session.pins[b] -= 1
            c = mgr.seal(b, k, nbytes)
            if c != b:
                session.replace(b, c)
                self.counters["seal_shared"] += 1
            else:
                self.placement.on_seal(c, cont, int(blocks.size))  # type: ignore[union-attr]
            out[i] = c
        self.counters["seals"] += int(blocks.size)
        return {"blocks": P.id_bytes(out)}

    def op_ref(self, session: EngineSession, args: Any) -> dict:
        mgr = self._need_mgr()
        keys = self._ids(args.keys, "keys", np.uint64)
        found = mgr.table.keys.get_many(keys).astype(np.int64)
        hit = found[found >= 0]
        if hit.size:
            np.add.at(mgr.table.refcount, hit, 1)
            session.add_refs(hit, args.seq)
        self.counters["ref_hits"] += int(hit.size)
        self.counters["ref_misses"] += int(keys.size - hit.size)
        return {"blocks": P.id_bytes(found)}

    def op_free(self, session: EngineSession, args: Any) -> dict:
        mgr = self._need_mgr()
        blocks = self._blocks(session, args, allow_keys=False)
        for b in blocks.tolist():
            if session.refs.get(b, 0) <= 0:
                raise ProtocolError(P.INVALID, f"block {b} is not held by engine {session.engine_id!r}")
            if session.pins[b] > 0:
                raise ProtocolError(P.INVALID, f"block {b} is pinned; release it before freeing")
        for b in blocks.tolist():
            mgr.free(b, allow_pinned=True)  # our pins were checked above; others' pins are theirs
            session.drop_ref(b)
        for s in args.seqs or []:
            session.seqs.pop(s, None)
        session.forget_blocks(set(blocks.tolist()))
        self.counters["frees"] += int(blocks.size)
        return {"freed": int(blocks.size)}

    def op_check(self, session: Optional[EngineSession], args: Any) -> dict:
        """Verify every metadata invariant (tests, `kvtier stats --check`)."""
        if self.mgr is not None:
            try:
                self.mgr.check_invariants()
            except RuntimeError as e:
                raise ProtocolError(P.INTERNAL, f"invariant broken: {e}") from None
            t = self.mgr.table
            held = sum((s.pins for s in self.engines.values()), np.zeros(t.max_blocks, dtype=np.int64))
            if np.any(t.pins < held) or np.any(held < 0):
                b = int(np.argmax((t.pins < held) | (held < 0)))
                raise ProtocolError(P.INTERNAL, f"block {b}: engines hold {held[b]} pins, table has {t.pins[b]}")
        return {"ok": True}

    def op_clear(self, session: Optional[EngineSession], args: Any) -> dict:
        """Drop every cached (unreferenced, idle) block: AllBlocksCleared."""
        mgr = self._need_mgr()
        t = mgr.table
        cached = np.flatnonzero((t.state != FREE) & (t.refcount == 0) & (t.pins == 0) & (t.busy == 0))
        for b in cached.tolist():
            mgr.drop(b)
        self.events.all_cleared()  # type: ignore[union-attr]
        return {"dropped": int(cached.size)}

    # -- telemetry -----------------------------------------------------------------------
    def ingest(self, msg: Any) -> int:
        """One telemetry message; returns block updates applied (bad ones are counted, not fatal)."""
        return ingest(self, msg)

    # -- background ------------------------------------------------------------------------
    def background(self, budget_s: float = 0.002) -> bool:
        """Idle-time work in small slices; returns True if anything was done."""
        if self.mgr is None:
            return False
        did = bool(self.mgr.poll())
        end = time.perf_counter() + budget_s
        while self.placement.backlog and time.perf_counter() < end:  # type: ignore[union-attr]
            self.placement.drain(64)  # type: ignore[union-attr]
            did = True
        return did

    def maintain(self) -> None:
        """Watermark demotion and prefetch; run after waiters have pinned what arrived."""
        if self.mgr is None:
            return
        tc = self.cfg.tiers
        self.placement.maintain(tc.high_watermark, tc.low_watermark)  # type: ignore[union-attr]
        if len(self.prefetcher):  # type: ignore[arg-type]
            self.prefetcher.run(self.mgr, self.placement, self.clock())  # type: ignore[union-attr,arg-type]
        elif self.cfg.policy.speculate:
            speculate(self.prefetcher, self.mgr, self.placement, tc.high_watermark, self.clock())  # type: ignore[arg-type]

    def apply_hot(self, cfg: KvtierConfig, changed: list[str]) -> None:
        """Take a reloaded config's hot sections (policy params, scoring, predictor)."""
        self.cfg = cfg
        if self.scores is not None and "scoring" in changed:
            self.scores.configure(**cfg.scoring.model_dump())
        if self.placement is not None and "policy" in changed:
            for pol in self.placement.policies.values():
                for k, v in cfg.policy.params().items():
                    if hasattr(pol, k) and not callable(getattr(pol, k)):
                        setattr(pol, k, v)
            if self.prefetcher is not None:
                self.prefetcher.budget_bytes_per_s = cfg.policy.prefetch_budget_bytes_per_s

    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.close()
        if self._hbm_shm is not None:
            release_shm(self._hbm_shm, unlink=False)
            self._hbm_shm = None


__all__ = ["Service"]
