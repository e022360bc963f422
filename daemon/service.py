"""The daemon's state machine: engines, dispatch, and the node built by the first register.

Socket-free, so it is tested directly and driven by ``server.py``'s owner
loop, the only thread that calls it. Every op validates fully before it
changes anything; misuse raises ``ProtocolError`` (an error reply) and leaves
state unchanged. The node (tier manager, placement, scores, prefetcher) is
built by the first ``register``: only then is the block size known (and, when
the engine brings its own HBM region, where HBM is). Ops that act on blocks
live in ``BlockOps`` and ``ResidencyOps``, built with the node.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import time
from collections import Counter
from typing import Any, Callable, Optional

import numpy as np

from kvtier.protocol import wire as P
from kvtier.protocol.wire import ProtocolError

from .acquire import Pending
from .block_ops import BlockOps
from .config import KvtierConfig
from .liveness import Fence, own_pid_namespace, pid_alive, pid_checkable
from .namespaces import Namespaces, as_geometry, describe, key_scope, owner_of
from .node import Node, build_node
from .remote_setup import attach_remote, start_remote_tier
from .residency import ResidencyOps
from .session import EngineSession
from .stats import snapshot
from .telemetry import ingest

log = logging.getLogger("kvtier.service")
FENCED_WHYS = frozenset({"timeout", "replaced"})  # reclaims whose process may still write its slots


class Service:
    def __init__(self, cfg: KvtierConfig, clock: Callable[[], float] = time.monotonic,
                 admin_token: Optional[str] = None) -> None:
        self.cfg = cfg
        self.admin_token = admin_token  # None: no check (in-process use); the server always sets one
        self.clock = clock
        self.node: Optional[Node] = None
        self.blocks: Optional[BlockOps] = None
        self.residency: Optional[ResidencyOps] = None
        self.engines: dict[str, EngineSession] = {}
        self.counters: Counter[str] = Counter()
        self.fences: list[Fence] = []  # silent engines' pins, kept until their process is gone
        self.orphans: list[tuple[Pending, ProtocolError]] = []  # waiters of reclaimed engines, still owed a reply
        self.pid_ns = own_pid_namespace()
        self.namespaces = Namespaces()
        self.remote_tier = start_remote_tier(cfg.tiers.remote, clock)  # a wrong password fails here, at start
        self.node_ops: dict[str, Callable[[EngineSession, Any], Any]] = {}
        self.ops: dict[str, Callable[[Optional[EngineSession], Any], Any]] = {
            "ping": self.op_ping, "heartbeat": self.op_ping, "stats": self.op_stats, "unregister": self.op_unregister,
            "check": self.op_check, "clear": self.op_clear,
        }

    # -- dispatch --------------------------------------------------------------
    def handle(self, req: P.Request, args: Any) -> Any:
        """Run one validated request: a result dict, or a ``Pending`` to answer later."""
        if req.op == "register":
            return self.op_register(req.engine, args)
        if req.op in P.ADMIN_OPS and not self.is_admin(args):
            raise ProtocolError(P.FORBIDDEN, f"{req.op} needs the daemon owner's token (admin.token in its runtime dir)")
        session = None
        if req.op not in P.NO_ENGINE_OPS:
            session = self.engines.get(req.engine)
            if session is None:
                raise ProtocolError(P.UNKNOWN_ENGINE, f"engine {req.engine!r} is not registered")
            session.last_seen = self.clock()
        try:
            op = self.ops.get(req.op)
            if op is not None:
                return op(session, args)
            node_op = self.node_ops.get(req.op)
            if node_op is None or session is None:
                raise ProtocolError(P.UNKNOWN_OP, f"op {req.op!r} is not served here")
            return node_op(session, args)
        except ValueError as e:
            raise ProtocolError(P.INVALID, str(e)) from None

    # -- engines -----------------------------------------------------------------
    def op_ping(self, session: Optional[EngineSession], args: Any) -> dict:
        from kvtier import __version__

        return {"pong": True, "version": __version__, "protocol": P.VERSION, "time": time.time()}

    def is_admin(self, args: Any) -> bool:
        token = getattr(args, "token", None)
        return self.admin_token is None or (token is not None and hmac.compare_digest(token, self.admin_token))

    def op_stats(self, session: Optional[EngineSession], args: Any) -> dict:
        return self.stats(full=self.is_admin(args))

    def stats(self, full: bool = True) -> dict:
        """The stats snapshot; without ``full``, other engines' ids and pids are left out."""
        out = snapshot(self.cfg, self.counters, self.engines, self.node, self.residency, self.clock)
        if not full:
            out["engines"] = [{"engine": "(needs the admin token)", "pid": 0, "live_blocks": 0, "pins": 0,
                               "sequences": 0}] * len(out["engines"])
        return out

    def op_register(self, engine_id: str, args: Any) -> dict:
        if not engine_id:
            raise ProtocolError(P.BAD_REQUEST, "register needs a non-empty engine id")
        node = self.node
        if node is None:
            node = self._start_node(args)
        else:
            if args.block_bytes > node.mgr.block_bytes:  # a smaller geometry (another model, a TP shard) fits a slot
                raise ProtocolError(P.CONFLICT, f"block_bytes {args.block_bytes} exceeds the daemon's slots of "
                                                f"{node.mgr.block_bytes} bytes (sized by the first engine): register "
                                                "the largest model first")
            conflict = node.region_conflict(args)
            if conflict:
                raise ProtocolError(P.CONFLICT, conflict)
        process = (int(args.pid), int(args.pid_ns))
        self._refuse_a_second_process(engine_id, process)
        geometry = as_geometry(args.block_bytes, args.block_tokens, dict(args.layout).get("dtype"))
        ns = self.namespaces.id(args.namespace, geometry)  # may refuse: before anything of the old session goes
        old = self.engines.get(engine_id)
        if old is not None:  # a restarted engine: its old holdings are void. Another process took the
            # id (the old one dead or silent past the timeout): fenced as a timeout is, as it may still write
            self.reclaim(engine_id, "re-registered" if (old.pid, old.pid_ns) == process else "replaced")
        for f in [f for f in self.fences if f.engine_id == engine_id and f.process == process]:
            self._lift(f)  # the same process starts over: its old client writes no more
        others = self.namespaces.others(args.namespace, geometry)
        if others and not args.refs_only:  # e.g. a vLLM scheduler whose size differs from its worker's: it would see nothing
            log.warning("engine %r registers namespace %r with blocks of %s, other engines "
                        "of it with %s: blocks are shared only between engines of one geometry",
                        engine_id, args.namespace, describe(geometry), ", ".join(describe(g) for g in others))
        self.engines[engine_id] = EngineSession(engine_id, args.pid, args.block_tokens, dict(args.layout),
                                                self.clock(), node.mgr.table.max_blocks,
                                                pid_checkable(args.pid, args.pid_ns, self.pid_ns), ns,
                                                key_scope(args.namespace), self.namespaces.group(ns),
                                                args.refs_only, block_bytes=args.block_bytes, pid_ns=int(args.pid_ns),
                                                tag=secrets.randbits(62))
        claimed = node.mgr.claim(owner_of(args.namespace, geometry), ns)  # its blocks a restart recovered
        if claimed:
            log.info("namespace %r (%s): %d recovered blocks are its own again",
                     args.namespace, describe(geometry), claimed)
        self.counters["registers"] += 1
        return node.hbm_info() | {"heartbeat_timeout_s": self.cfg.server.heartbeat_timeout_s,
                                  "block_bytes": args.block_bytes, "slot_bytes": node.mgr.block_bytes,
                                  "layers": node.layer_parts(args.block_bytes, args.layout),
                                  "session_tag": self.engines[engine_id].tag}

    def _refuse_a_second_process(self, engine_id: str, process: tuple[int, int]) -> None:
        """An engine id names one process. Another process registering a live engine's id
        would take over its pins and blocks while it still writes their slots, and the old
        client, whose requests carry only the id, would go on using the new session. A
        register from the same process (pid and pid namespace), or after the old process
        is seen dead, or once the old one has been silent a heartbeat timeout, is a restart."""
        old = self.engines.get(engine_id)
        if old is None or (old.pid, old.pid_ns) == process:
            return
        alive = (pid_alive(old.pid) if old.pid_checkable
                 else self.clock() - old.last_seen <= self.cfg.server.heartbeat_timeout_s)
        if alive:
            raise ProtocolError(P.CONFLICT, f"engine id {engine_id!r} is in use by another live process (pid "
                                            f"{old.pid}): give each engine a unique id (a process the daemon "
                                            "cannot see counts as live until it has been silent "
                                            f"{self.cfg.server.heartbeat_timeout_s:g} s)")

    def _start_node(self, args: Any) -> Node:
        node = build_node(self.cfg, args, self.clock)
        if self.remote_tier is not None:
            attach_remote(node, self.cfg.tiers.remote, self.remote_tier, self.namespaces, self.counters, self.clock)
        node.ns_group = self.namespaces.groups  # read by refs-only engines' lookups (one owner: namespaces)
        self.node = node
        self.blocks = BlockOps(node, self.cfg, self.counters, self.clock, self.engines)
        self.residency = ResidencyOps(node, self.cfg, self.counters, self.clock)
        b, r = self.blocks, self.residency
        b.acquiring = r.pinned_by_waiters
        b.pin_landed = self._pin_landed
        self.node_ops = {"alloc": b.op_alloc, "seal": b.op_seal, "ref": b.op_ref, "lookup": b.op_lookup, "free": b.op_free,
                         "acquire": r.op_acquire, "acquire_poll": r.op_acquire_poll, "release": r.op_release,
                         "hint": r.op_hint}
        return node

    def op_unregister(self, session: Optional[EngineSession], args: Any) -> dict:
        assert session is not None  # an engine op: handle() found its session
        return {"reclaimed": self.reclaim(session.engine_id, "unregistered")}

    def reclaim(self, engine_id: str, why: str) -> int:
        """Drop an engine's pins, waiters and references; other engines are untouched.

        A silent engine (``why`` "timeout", or "replaced": another process registered its
        id) whose process may still run is fenced: its pins and references stay in the
        table until its process is gone (see ``liveness``), so no other engine is handed a
        slot it may still be writing."""
        session = self.engines.pop(engine_id, None)
        if session is None or self.node is None:
            return 0
        assert self.blocks is not None and self.residency is not None  # built with the node
        gone = ProtocolError(P.UNKNOWN_ENGINE, f"engine {engine_id!r} was reclaimed ({why})")
        for w in [*self.residency.drop_waiters(session), *self.blocks.drop_waiters(session)]:
            self.orphans.append((w, gone))
        held = session.pins.nonzero_ids()
        self.counters[f"reclaimed_{why.replace('-', '_')}"] += 1
        may_write = why in FENCED_WHYS and (not session.pid_checkable or pid_alive(session.pid))
        if may_write and held.size:  # keep what it holds until it surely cannot write any more
            pins = np.repeat(held, session.pins[held])
            self.fences.append(Fence(engine_id, session.pid if session.pid_checkable else None,
                                     (session.pid, session.pid_ns), pins,
                                     dict(session.refs.items()), self.clock()))
            self.counters["fenced_pins"] += int(pins.size)
            return session.refs.held
        self._unpin(held, session.pins[held])
        return self._free_refs(session.refs)

    def _free_refs(self, refs: Any) -> int:
        """Drop every reference of ``refs`` (block -> count: a fence's dict or a session's counts)."""
        assert self.node is not None
        blocks = 0
        for b, n in refs.items():
            blocks += 1
            for _ in range(n):
                self.node.mgr.free(b, allow_pinned=True)  # another engine may hold a shared block pinned
        return blocks

    def _unpin(self, blocks: np.ndarray, counts: np.ndarray) -> None:
        """Release ``counts[i]`` pins of ``blocks[i]`` through the manager (dead blocks are reaped)."""
        assert self.node is not None
        left = counts.astype(np.int64).copy()
        while blocks.size:
            self.node.mgr.unpin_many(blocks)
            left -= 1
            blocks, left = blocks[left > 0], left[left > 0]

    def check_engines(self) -> list[str]:
        """Reclaim engines whose heartbeat timed out or whose process died; lift fences
        whose engine's process is gone."""
        now = self.clock()
        gone = []
        for eid, s in list(self.engines.items()):
            if now - s.last_seen > self.cfg.server.heartbeat_timeout_s:
                self.reclaim(eid, "timeout")
                gone.append(eid)
            elif s.pid_checkable and not pid_alive(s.pid):
                self.reclaim(eid, "process-died")
                gone.append(eid)
        for f in [f for f in self.fences if f.due(now, self.cfg.server.fence_timeout_s)]:
            self._lift(f)
        return gone

    def _lift(self, f: Fence) -> None:
        """Release what a fenced engine held: its slots may be handed out again."""
        self.fences.remove(f)
        blocks, counts = np.unique(f.pins, return_counts=True)
        self._unpin(blocks, counts)
        self._free_refs(f.refs)
        self.counters["fences_lifted"] += 1

    def excuse_stall(self, seconds: float) -> None:
        """The owner loop was away ``seconds``: no engine could be heard meanwhile, so none is blamed."""
        for s in self.engines.values():
            s.last_seen += seconds

    # -- whole-node ops (no engine needed) ----------------------------------------------
    def op_check(self, session: Optional[EngineSession], args: Any) -> dict:
        return self.blocks.op_check(session, args) if self.blocks is not None else {"ok": True}

    def op_clear(self, session: Optional[EngineSession], args: Any) -> dict:
        if self.blocks is None:
            raise ProtocolError(P.INVALID, "no engine has registered yet: the block size is unknown")
        return self.blocks.op_clear(session, args)

    # -- telemetry -----------------------------------------------------------------------
    def frees(self) -> int:
        """The block table's count of frees, sent with every reply: telemetry stamps (``telemetry``)."""
        return self.node.mgr.table.releases if self.node is not None else 0

    def ingest(self, msg: Any) -> int:
        """One telemetry message; returns block updates applied (bad ones are counted, not fatal)."""
        engine = msg.get("engine") if isinstance(msg, dict) else None
        session = self.engines.get(engine) if isinstance(engine, str) else None
        if self.node is None or session is None:  # only a registered engine reports, on its own blocks
            self.counters["telemetry_rejected"] += 1
            return 0
        return ingest(self.node, self.counters, msg, session)

    # -- background ------------------------------------------------------------------------
    def background(self, budget_s: float = 0.002) -> bool:
        """Idle-time work in small slices; returns True if anything was done."""
        if self.node is None:
            return False
        try:
            did = bool(self.node.mgr.poll())
        except Exception:  # a listener's error: what was applied still goes to its waiters
            self._pin_landed()
            raise
        if did:
            self._pin_landed()
        if self.node.remote is not None:
            did = bool(self.node.remote.poll()) or did
            did = bool(self.node.remote.publish(self.clock())) or did
        end = time.perf_counter() + budget_s
        while self.node.placement.backlog and time.perf_counter() < end:
            self.node.placement.drain(64)
            did = True
        return did

    def _pin_landed(self) -> None:
        """Blocks that just landed go to the acquires waiting on them, before any room is made."""
        if self.residency is not None and self.residency.waiters:
            self.residency.pin_landed()

    def advance(self) -> list[tuple[Any, Any]]:
        """Waiting acquires and allocs that finished: (waiter, result or ProtocolError),
        reclaimed engines' waiters first (they are told so)."""
        out: list[tuple[Any, Any]] = self.orphans
        self.orphans = []
        if self.residency is None or self.blocks is None:
            return out
        remote = self.node.remote.advance(self.node.lookup, self.engines) if self.node is not None and self.node.remote else []
        return [*out, *remote, *self.residency.advance_waiters(), *self.blocks.advance_allocs()]

    def busy(self) -> bool:
        """Is there work the owner loop should come back for within a millisecond?"""
        if self.node is None or self.residency is None or self.blocks is None:
            return False
        return bool(self.residency.waiters or self.blocks.alloc_waiters) or self.node.busy()

    def maintain(self) -> None:
        """Watermark demotion and prefetch; run after waiters have pinned what arrived."""
        node = self.node
        if node is None:
            return
        tc = self.cfg.tiers
        node.placement.maintain(tc.high_watermark, tc.low_watermark)
        if len(node.prefetcher):
            node.prefetcher.run(node.mgr, node.placement, self.clock())
        elif self.cfg.policy.speculate:
            node.prefetcher.speculate(node.mgr, node.placement, tc.high_watermark, self.clock())

    def apply_hot(self, cfg: KvtierConfig, changed: list[str]) -> None:
        """Take a reloaded config's hot sections (policy params, scoring, predictor), all or
        none: a section that fails puts back the ones applied before it, and the running
        config stays what the daemon says it keeps."""
        if self.node is not None:
            try:
                self._configure_node(cfg, changed)
            except Exception:
                self._configure_node(self.cfg, changed)
                raise
        self.cfg = cfg
        for ops in (self.blocks, self.residency):
            if ops is not None:
                ops.cfg = cfg

    def _configure_node(self, cfg: KvtierConfig, changed: list[str]) -> None:
        node = self.node
        assert node is not None
        if "scoring" in changed:
            scored = node.scored()  # before: a tag the new settings remove leaves its blocks untagged
            node.scores.configure(**cfg.scoring.model_dump())
            node.rescore(scored)
        if "policy" in changed:
            node.placement.configure(cfg.policy.params())
            node.prefetcher.budget_bytes_per_s = cfg.policy.prefetch_budget_bytes_per_s
        if "predictor" in changed:
            pr = cfg.predictor
            node.placement.configure_predictor(pr.track_calibration, pr.calibration_bins, pr.calibration_sample,
                                               pr.recalibrate)

    def close(self) -> None:
        if self.node is not None:
            self.node.close()
        elif self.remote_tier is not None:
            self.remote_tier.close()


__all__ = ["Service"]
