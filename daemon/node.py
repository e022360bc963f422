"""The node: everything that exists once the block size is known, built by the first register.

Before any engine registers, the daemon has no block size and so no tiers. The
first ``register`` builds one ``Node``: the tier manager (the only writer of
block metadata), the placement policies, the importance scores, the event
collector and the prefetcher, all at once and all non-optional. The service
holds one ``Optional[Node]``; everything below it can rely on a full node.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import torch

from kvtier.protocol import wire as P
from kvtier.protocol.cuda_ipc import region_identity
from kvtier.protocol.runtime import ensure_private_dir
from kvtier.protocol.shm import attach_shm, release_shm, unlink_on_error
from kvtier.protocol.wire import ProtocolError
from kvtier.scoring.importance import ImportanceScores
from kvtier.tiers.io_backends import select_backend
from kvtier.tiers.manager import TierManager
from kvtier.tiers.pools import round_up
from kvtier.tiers.types import FREE, HBM

from .acquire import Prefetcher
from .config import KvtierConfig
from .events import EventCollector
from .namespaces import scoped_keys
from .placement import Placement
from .session import EngineSession

if TYPE_CHECKING:
    from .remote_ops import RemoteOps

log = logging.getLogger("kvtier.node")


@dataclass
class Node:
    """The block state of this daemon and the objects that decide over it."""

    mgr: TierManager
    placement: Placement
    scores: ImportanceScores
    events: EventCollector
    prefetcher: Prefetcher
    block_tokens: int
    layers: int  # parts a DRAM -> HBM promotion is copied and reported in (the engine's layers)
    max_batch_blocks: int
    hbm_shm: Optional[shared_memory.SharedMemory] = None  # an engine-supplied region we mapped
    hbm_handle: bytes = b""  # CUDA IPC handle of a daemon-allocated device pool, for engines to map
    engine_region: tuple = ()  # ``region_identity`` of the engine's own CUDA region the node was built on
    remote: "Optional[RemoteOps]" = None  # the shared remote tier, when [tiers.remote] is enabled
    # namespace id -> its name's group (``Namespaces.groups``, set by the service): refs-only lookups
    ns_group: np.ndarray = field(default_factory=lambda: np.zeros(1 << 16, dtype=np.uint16))

    # -- request helpers ----------------------------------------------------------------
    def ids(self, value: Any, what: str, dtype: type = np.int64) -> np.ndarray:
        return P.ids(value, dtype, self.max_batch_blocks, what)

    def lookup(self, session: EngineSession, keys: np.ndarray) -> np.ndarray:
        """Blocks of ``session``'s namespace sealed under ``keys`` (-1 where none)."""
        found = self.mgr.table.keys.get_many(scoped_keys(keys, session.scope)).astype(np.int64)
        hit = found >= 0
        found[hit] = np.where(self.mine(session, found[hit]), found[hit], -1)
        return found

    def mine(self, session: EngineSession, blocks: np.ndarray) -> np.ndarray:
        """Per block: ``session`` may see it. Its own namespace's; for a refs-only engine (a
        scheduler, which never touches bytes) any geometry of its namespace's name."""
        ns = self.mgr.namespace[blocks]
        if session.refs_only:
            return self.ns_group[ns] == session.group
        return ns == session.ns

    def resolve(self, session: EngineSession, args: Any, allow_keys: bool = True) -> np.ndarray:
        """Blocks / keys / seqs of a request as unique live block ids of the engine's namespace."""
        named = self.ids(getattr(args, "blocks", None), "blocks")
        if named.size:
            named = self.mgr.check_blocks(named)
            other = ~self.mine(session, named)
            if other.any():  # another namespace's block: as if it did not exist
                raise ProtocolError(P.INVALID, f"unknown block {int(named[np.argmax(other)])}")
        parts = [named]
        if allow_keys and getattr(args, "keys", None) is not None:
            keys = self.ids(args.keys, "keys", np.uint64)
            found = self.lookup(session, keys)
            if (found < 0).any():
                raise ProtocolError(P.INVALID, f"unknown key {int(keys[np.argmax(found < 0)]):#x}")
            parts.append(found)
        if getattr(args, "seqs", None):
            parts.append(session.seq_blocks(args.seqs))
        if len(parts) > 1:
            return self.mgr.check_blocks(np.unique(np.concatenate(parts)))  # overlapping sources: sorted union
        if named.size:
            return named  # checked above (once: a check is ~14 us of a 128-block release)
        return self.mgr.check_blocks(parts[0])  # one source: the caller's order, so replies line up with it

    def set_importance(self, blocks: np.ndarray) -> None:
        """Importance of ``blocks`` changed: refresh the table column and every policy's weights."""
        self.mgr.set_importance(blocks, self.scores.score(blocks))
        w = self.scores.weight(blocks)
        for pol in self.placement.policies.values():
            pol.set_weights(blocks, w)

    def scored(self) -> np.ndarray:
        """Live blocks scored so far (a report or a segment tag)."""
        s = self.scores
        return np.flatnonzero((self.mgr.table.state != FREE) & ((s.reports > 0) | (s.segment != 0)))

    def rescore(self, blocks: Optional[np.ndarray] = None) -> int:
        """``[scoring]`` was reloaded: every live block scored before (``scored``, taken before
        the new settings: a tag they remove maps its blocks to no segment) is scored again, or
        an idle block, the kind demotion looks at, would keep the old segment weights and floor
        until a report that may never come. O(blocks), once a reload. Structural priors stay
        those of the settings at each block's last report (its place in it is not kept).
        Returns the blocks rescored."""
        blocks = self.scored() if blocks is None else blocks
        if blocks.size:
            self.set_importance(blocks)
        return int(blocks.size)

    def layer_parts(self, block_bytes: int, layout: dict) -> int:
        """Layer parts an engine may read a promotion by: layer-wise progress is counted in
        the first engine's layer parts, so only an engine of that geometry gets them; any
        other reads whole blocks (1 part)."""
        same = block_bytes == self.mgr.block_bytes and layout.get("layers", 1) == self.layers
        return self.layers if same else 1

    def hbm_info(self) -> dict:
        """What an engine needs to map HBM: the region's kind, name or handle, and geometry."""
        mgr = self.mgr
        name = self.hbm_shm.name if self.hbm_shm is not None else (mgr.hbm.shm_name or "")
        return {"hbm_kind": "cuda" if mgr.hbm.is_cuda else "shm", "hbm_name": name,
                "hbm_handle": self.hbm_handle, "hbm_slots": mgr.table.slots_per_tier[HBM],
                "slot_stride": mgr.hbm.slot_stride, "block_bytes": mgr.block_bytes}

    def region_conflict(self, args: Any) -> str:
        """Why a later engine's register cannot share this node's HBM region ('' where it can):
        a daemon has one region, so an engine bringing its own must bring this one (else its
        seals would index the daemon's bytes, not its own), and one bringing none must be able
        to map it (an engine's own device memory is not handed on; refs-only engines touch no
        slot)."""
        info = self.hbm_info()
        if args.hbm_kind == "shm":
            same = args.hbm_name == info["hbm_name"]
        elif args.hbm_kind == "cuda_ipc":
            try:
                same = bool(self.engine_region) and region_identity(args.hbm_handle) == self.engine_region
            except ValueError:
                same = False
        else:
            same = True
        if not same:
            return "the daemon already manages another HBM region"
        if args.hbm_kind == "daemon" and not args.refs_only and info["hbm_kind"] == "cuda" and not info["hbm_handle"]:
            return ("the daemon's HBM region is the first engine's own device memory, which it cannot hand "
                    "on: register with that region or restart the daemon")
        return ""

    def busy(self) -> bool:
        """Work the owner loop should come back for soon (transfers, backlog, queued hints)."""
        return (self.mgr.has_pending() or bool(self.placement.backlog) or bool(len(self.prefetcher))
                or (self.remote is not None and self.remote.busy()))

    def close(self) -> None:
        if self.remote is not None:  # its workers read and write slots of the pools closed next
            self.remote.close()
        self.mgr.close()
        if self.hbm_shm is not None:
            release_shm(self.hbm_shm, unlink=False)
            self.hbm_shm = None


def _map_shm_region(args: Any, stride: int) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
    if not args.hbm_name or args.hbm_slots <= 0:
        raise ProtocolError(P.BAD_REQUEST, "hbm_kind 'shm' needs hbm_name and hbm_slots")
    try:
        shm = attach_shm(args.hbm_name)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise ProtocolError(P.INVALID, f"cannot map HBM region {args.hbm_name!r}: {e}") from None
    if shm.size < args.hbm_slots * stride:
        release_shm(shm, unlink=False)
        raise ProtocolError(P.INVALID, f"HBM region has {shm.size} bytes, need {args.hbm_slots * stride}")
    return shm, torch.frombuffer(shm.buf, dtype=torch.uint8, count=args.hbm_slots * stride)


def _map_cuda_region(args: Any, stride: int) -> torch.Tensor:
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
    return tensor


def _tier_error(e: OSError) -> ProtocolError:
    """A failed tier build as the engine sees it: ``no_space`` for ENOSPC (a smaller
    pool or more room fixes it), ``invalid`` for anything else (the config does)."""
    code = P.NO_SPACE if e.errno == errno.ENOSPC else P.INVALID
    where = f"{e.filename}: " if e.filename else ""
    return ProtocolError(code, f"cannot build the tiers: {where}{e.strerror or e}")


def _build_manager(cfg: KvtierConfig, args: Any, hbm_tensor: Optional[torch.Tensor], hbm_slots: int,
                   stride: int, clock: Callable[[], float]) -> TierManager:
    """The tier manager, or nothing: on failure its I/O threads are stopped and an
    NVMe directory made here (still empty) is removed; the caller unlinks pools."""
    tc = cfg.tiers
    dram_slots, nvme_slots = tc.dram_bytes // stride, tc.nvme_bytes // stride
    nvme_dir, made_dir = None, False
    if nvme_slots:
        made_dir = not os.path.lexists(tc.nvme_dir)
        nvme_dir = str(ensure_private_dir(tc.nvme_dir))  # refuses a symlink or someone else's directory
    backend = select_backend(tc.io_backend, tc.io_threads)
    try:
        return TierManager(
            args.block_bytes, hbm_slots, dram_slots, nvme_slots, nvme_dir=nvme_dir,
            max_blocks=tc.max_blocks or max(1, hbm_slots + dram_slots + nvme_slots), io_backend=backend,
            mover_workers=tc.mover_workers, queue_depth=tc.mover_queue_depth, hbm_tensor=hbm_tensor,
            dram_numa_node=tc.dram_numa_node, recover_payloads=tc.recovery_verify == "payload", clock=clock)
    except BaseException:
        backend.shutdown()
        if made_dir and nvme_dir is not None:
            try:
                os.rmdir(nvme_dir)
            except OSError:
                pass  # not empty: something else wrote there
        raise


def build_node(cfg: KvtierConfig, args: Any, clock: Callable[[], float]) -> Node:
    """The node for the first engine's geometry (``register`` arguments).

    All or nothing: a failure releases what was built (shared-memory pools
    unlinked, new slab files removed, threads stopped) and raises a
    ProtocolError naming the path and the reason, so a failed register can be
    retried without leaking memory or disk."""
    try:
        return _build_node(cfg, args, clock)
    except OSError as e:
        raise _tier_error(e) from None
    except ValueError as e:  # a bad NUMA node, a region of the wrong size
        raise ProtocolError(P.INVALID, f"cannot build the tiers: {e}") from None


def _build_node(cfg: KvtierConfig, args: Any, clock: Callable[[], float]) -> Node:
    stride = round_up(args.block_bytes)
    hbm_tensor, hbm_shm = None, None
    hbm_slots = cfg.tiers.hbm_bytes // stride
    try:
        with unlink_on_error():  # the pools of a manager that failed half-way
            if args.hbm_kind == "shm":
                hbm_shm, hbm_tensor = _map_shm_region(args, stride)
                hbm_slots = args.hbm_slots
            elif args.hbm_kind == "cuda_ipc":
                hbm_tensor, hbm_slots = _map_cuda_region(args, stride), args.hbm_slots
            mgr = _build_manager(cfg, args, hbm_tensor, hbm_slots, stride, clock)
    except BaseException:
        if hbm_shm is not None:
            release_shm(hbm_shm, unlink=False)  # the engine's region: unmapped, never unlinked
        raise
    try:
        return _complete_node(cfg, args, mgr, hbm_tensor, hbm_shm, clock)
    except BaseException:
        mgr.close()
        if hbm_shm is not None:
            release_shm(hbm_shm, unlink=False)
        raise


def attach_deciders(cfg: KvtierConfig, mgr: TierManager, block_bytes: int, block_tokens: int = 16,
                    layers: int = 1, clock: Callable[[], float] = time.monotonic) -> Node:
    """A node over a manager built elsewhere (``bench tiers``): the daemon's placement, scores,
    events and prefetcher, listening to its moves as they do in a running daemon."""
    args = SimpleNamespace(block_bytes=block_bytes, block_tokens=block_tokens, layout={"layers": layers})
    return _complete_node(cfg, args, mgr, None, None, clock)


def _complete_node(cfg: KvtierConfig, args: Any, mgr: TierManager, hbm_tensor: Optional[torch.Tensor],
                   hbm_shm: Optional[shared_memory.SharedMemory], clock: Callable[[], float]) -> Node:
    """The deciding objects over a built manager (and its host copy loop, chosen first: timing
    it takes the DRAM pool as scratch, before any block can land there)."""
    log.info("host copy loop: %s", mgr.tune_copy_loop(cfg.tiers.copy_loop).describe())
    if mgr.nvme is not None:
        log.info("NVMe tier: %d cached blocks recovered (%s, %d slots discarded)", mgr.recovered,
                 mgr.recovered_from or "nothing to recover", mgr.discarded)
    handle = b""
    if hbm_tensor is None and mgr.hbm.is_cuda:
        from kvtier.protocol.cuda_ipc import export_handle

        handle = export_handle(mgr.hbm.tensor)
    layers = args.layout.get("layers", 1)
    layers = layers if isinstance(layers, int) and layers > 0 and args.block_bytes % layers == 0 else 1
    pc, pr = cfg.policy, cfg.predictor
    params = pc.params() | {"track_calibration": pr.track_calibration, "calibration_bins": pr.calibration_bins,
                            "calibration_sample": pr.calibration_sample, "calibration_window": 1 << 17,
                            "recalibrate": pr.recalibrate}
    placement = Placement(mgr, pc.name, params, clock)  # listeners in this order: placement, events, prefetch
    scores = ImportanceScores(mgr.table.max_blocks, **cfg.scoring.model_dump())

    def _freed(kind: str, b: int, tier: int) -> None:  # a gone block's id is reused fresh
        if kind == "removed" and tier < 0:
            scores.forget(np.array([b]))

    def _freed_many(kind: str, blocks: np.ndarray, tier: int) -> None:
        if kind == "removed" and tier < 0:
            scores.forget(blocks)

    mgr.listeners.append(_freed)
    mgr.batch_listeners[_freed] = _freed_many
    events = EventCollector(mgr, args.block_tokens)
    prefetcher = Prefetcher(pc.prefetch_budget_bytes_per_s, args.block_bytes, mgr.table.max_blocks)
    mgr.listeners.append(prefetcher.on_event)
    mgr.batch_listeners[prefetcher.on_event] = prefetcher.on_events
    return Node(mgr=mgr, placement=placement, scores=scores, events=events, prefetcher=prefetcher,
                block_tokens=args.block_tokens, layers=layers, max_batch_blocks=cfg.server.max_batch_blocks,
                hbm_shm=hbm_shm, hbm_handle=handle,
                engine_region=region_identity(args.hbm_handle) if getattr(args, "hbm_kind", "") == "cuda_ipc" else ())


__all__ = ["Node", "build_node", "attach_deciders"]
