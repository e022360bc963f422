"""Every byte of per-block metadata a running daemon holds, found by walking its objects.

A hand-kept list of arrays goes stale the day someone adds a column. Instead
this builds a real ``Service`` in process, registers engines (the first
register builds the real ``Node``: tier manager, placement and its policies,
scores, predictor, prefetcher, events) and walks the object graph from the
service: every numpy array it can reach is counted once (by the buffer that
owns its bytes), every Python container by ``sys.getsizeof``. Pool bytes are
not metadata and are skipped: arrays over foreign buffers (shared memory,
mmap), torch tensors, shared-memory segments. The walk also names where the
bytes sit, so a report says which part costs what.

Slots are per slot, not per block: their cost is measured by difference (the
same node with twice the slots of one tier) and added at the node-scale
shares (HBM 25%, DRAM 25%, NVMe 50% of the blocks, one slot per block, as the
default ``tiers.max_blocks`` = the total slot count gives). Blocks held by
engines (refs, sequences) are measured by difference too: an engine holding
every HBM slot's block against the same engine holding none.
"""

from __future__ import annotations

import array
import gc
import sys
import tempfile
import types
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import numpy as np

BLOCK_BYTES = 4096  # one page: the smallest slot a pool has (tiny slots, metadata is what we count)
SHARES = {"hbm": 0.25, "dram": 0.25, "nvme": 0.5}
_SKIP_TYPES: tuple[type, ...] = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                                 types.CodeType, types.FrameType, str, bytes, bool, type(None), memoryview)
SMALL_INTS = range(-5, 257)  # CPython's cached ints: shared, never allocated per block


def _skip_type_names() -> tuple[str, ...]:
    """Objects that hold pool bytes or OS resources, not metadata (matched by name: no torch import here)."""
    return ("Tensor", "SharedMemory", "mmap", "Thread", "ThreadPoolExecutor", "Lock", "RLock", "Condition",
            "Event", "Logger", "Stream", "Popen", "Context", "Socket", "Poller", "local")


@dataclass
class Walk:
    """Bytes reachable from a root, and where (the first path that reached each object)."""

    total: int = 0
    arrays: int = 0
    by_path: dict[str, int] = field(default_factory=lambda: defaultdict(int))


def _owner(a: np.ndarray) -> Optional[np.ndarray]:
    """The array that owns ``a``'s bytes, or None if they belong to a foreign buffer (a pool)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a if a.base is None else None


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"[{k!r}]" if isinstance(k, (str, int)) else "[.]", v
            if not isinstance(k, (str, int, float, bytes)):
                yield "[key]", k
        return
    if isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
        for i, v in enumerate(obj):
            yield f"[{i}]" if isinstance(obj, (list, tuple)) else "[.]", v
        return
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        yield from ((f".{k}", v) for k, v in d.items())
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name) and name != "__dict__":
                yield f".{name}", getattr(obj, name)


def walk(root: Any, depth: int = 3) -> Walk:
    """Sum the metadata bytes reachable from ``root`` (see the module doc); ``by_path``
    groups them by the first ``depth`` steps of the path that reached them."""
    out = Walk()
    seen: set[int] = set()
    skip_names = _skip_type_names()
    todo: deque[tuple[str, Any]] = deque([("", root)])  # breadth first: each object is named by a shortest path
    while todo:
        path, obj = todo.popleft()
        if isinstance(obj, _SKIP_TYPES) or type(obj).__name__ in skip_names or callable(obj) and not hasattr(
                obj, "__dict__"):
            continue
        if isinstance(obj, types.MethodType):
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        key = "".join(_split(path)[:depth]) or "(root)"
        if isinstance(obj, np.ndarray):
            own = _owner(obj)
            if own is None or own is not obj and id(own) in seen:
                continue  # a pool's bytes, or an owner counted already
            seen.add(id(own))
            out.total += own.nbytes
            out.arrays += 1
            out.by_path[key] += own.nbytes
            continue
        if isinstance(obj, np.generic):
            continue
        if isinstance(obj, (int, float)):  # a Counter's or a list's block ids are objects of their own
            if not (isinstance(obj, int) and obj in SMALL_INTS):
                out.total += sys.getsizeof(obj)
                out.by_path[key] += sys.getsizeof(obj)
            continue
        size = sys.getsizeof(obj, 0) if isinstance(obj, (dict, list, tuple, set, frozenset, array.array)) or \
            type(obj).__name__ in ("deque", "Counter", "OrderedDict", "defaultdict") else 0
        out.total += size
        out.by_path[key] += size
        todo.extend((path + step, child) for step, child in _children(obj))
    return out


def _split(path: str) -> list[str]:
    parts, cur = [], ""
    for ch in path:
        if ch in ".[" and cur:
            parts.append(cur)
            cur = ""
        cur += ch
    return parts + ([cur] if cur else [])


def _service(directory: str, max_blocks: int, slots: tuple[int, int, int], policy: str = "kvtier") -> Any:
    from kvtier.daemon.config import load_config
    from kvtier.daemon.service import Service

    cfg = load_config(environ={}, overrides=[
        f"tiers.hbm_bytes={slots[0] * BLOCK_BYTES}", f"tiers.dram_bytes={slots[1] * BLOCK_BYTES}",
        f"tiers.nvme_bytes={slots[2] * BLOCK_BYTES}", f"tiers.max_blocks={max_blocks}",
        f'tiers.nvme_dir="{directory}/nvme"', f'server.runtime_dir="{directory}/run"', "metrics.enabled=false",
        f'policy.name="{policy}"', 'tiers.io_backend="posix"'])
    return Service(cfg)


def _call(svc: Any, op: str, engine: str, **args: Any) -> Any:
    from kvtier.protocol import wire as P

    req, a = P.decode_request(P.pack({"v": 1, "id": 1, "op": op, "engine": engine, "args": args}), 1 << 26)
    return svc.handle(req, a)


def _register(svc: Any, engines: int) -> None:
    for e in range(engines):
        _call(svc, "register", f"e{e}", pid=0, block_bytes=BLOCK_BYTES, block_tokens=16)


def service_bytes(max_blocks: int, slots: tuple[int, int, int], engines: int = 1, hold: int = 0,
                  policy: str = "kvtier") -> Walk:
    """Walk a freshly registered service; ``hold`` blocks allocated and sealed by engine e0 (one sequence)."""
    from kvtier.protocol import wire as P

    with tempfile.TemporaryDirectory(prefix="kvtier-meta-") as d:
        svc = _service(d, max_blocks, slots, policy)
        try:
            _register(svc, engines)
            # ids past CPython's cached small ints, as a running daemon's are: the held blocks'
            # ids are then int objects of their own (the free list hands out the next ids)
            if hold:
                _call(svc, "free", "e0", blocks=_call(svc, "alloc", "e0", n=hold)["blocks"])
                blocks = np.frombuffer(_call(svc, "alloc", "e0", n=hold, seq=1)["blocks"], dtype="<i8")
                _call(svc, "seal", "e0", blocks=P.id_bytes(blocks),
                      keys=P.id_bytes(np.arange(1, hold + 1, dtype=np.uint64) * 0x9E3779B97F4A7C15, np.uint64))
            if svc.node is not None:
                svc.node.events.take_batch()  # events wait one loop turn, not per block for ever
            gc.collect()
            return walk(svc)
        finally:
            svc.close()


def report(blocks: int = 1_000_000, engines: int = 1, policy: str = "kvtier") -> dict[str, Any]:
    """Metadata bytes per block of a running daemon at ``blocks`` blocks (see the module doc)."""
    tiny, base_blocks = 256, 8192
    big = service_bytes(blocks, (tiny, tiny, tiny), engines, policy=policy)
    base = service_bytes(base_blocks, (tiny, tiny, tiny), engines, policy=policy)
    per_slot = {}
    for i, name in enumerate(SHARES):
        more = (tiny * (1 + (i == 0)), tiny * (1 + (i == 1)), tiny * (1 + (i == 2)))
        per_slot[name] = (service_bytes(base_blocks, more, engines, policy=policy).total - base.total) / tiny
    held = service_bytes(base_blocks, (tiny, tiny, tiny), engines, hold=tiny, policy=policy)
    per_held = (held.total - base.total) / tiny
    slot_bytes = sum(per_slot.values()) * tiny  # what the tiny slots of the big node cost: not per block
    per_block = (big.total - slot_bytes) / blocks
    per_slot_blended = sum(SHARES[k] * v for k, v in per_slot.items())
    parts = sorted(((k, v / blocks) for k, v in big.by_path.items() if v / blocks >= 0.5), key=lambda kv: -kv[1])
    return {
        "blocks": blocks, "engines": engines, "policy": policy,
        # engines hold (reference, and sequence) at least the blocks in HBM: those are counted too
        "metadata_bytes_per_block_all": per_block + per_slot_blended + SHARES["hbm"] * per_held,
        "per_block_arrays_bytes": per_block, "per_slot_bytes": per_slot,
        "per_slot_bytes_blended": per_slot_blended, "per_held_block_bytes": per_held,
        "arrays_counted": big.arrays, "by_part": dict(parts),
        "note": "all = per-block arrays + slots at HBM 25% / DRAM 25% / NVMe 50% of the blocks + "
                "per_held_block_bytes (engine refs and sequences of a live block) for the HBM 25% engines hold",
    }


__all__ = ["walk", "Walk", "service_bytes", "report"]
