"""Trace readers: Mooncake and Qwen-Bailian JSONL, flattened to access arrays.

Mooncake: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}``
(512-token blocks). Qwen-Bailian: ``{"chat_id", "parent_chat_id",
"timestamp": s, "input_length", "output_length", "type", "turn",
"hash_ids"}`` (16-token blocks). The format is detected per file from the
first record. Per-access block classes are computed in one causal pass: each
uses only requests that arrived earlier.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional, TypedDict

import numpy as np

from kvtier.policy.base import NEVER
from kvtier.predictor.classes import block_class


class TraceFormat(TypedDict):
    required: tuple[str, ...]
    time_scale: float
    block_tokens: int


FORMATS: dict[str, TraceFormat] = {
    "mooncake": {"required": ("timestamp", "hash_ids"), "time_scale": 1e-3, "block_tokens": 512},
    "bailian": {"required": ("chat_id", "timestamp", "hash_ids", "turn"), "time_scale": 1.0, "block_tokens": 16},
}


class TraceError(ValueError):
    pass


@dataclass
class Trace:
    name: str
    format: str
    block: np.ndarray  # dense block id per access
    time_s: np.ndarray
    cls: np.ndarray
    request: np.ndarray
    n_requests: int
    n_unique: int

    @property
    def n_accesses(self) -> int:
        return int(self.block.size)

    def next_use(self) -> np.ndarray:
        """Index of each access's next access to the same block (big if none)."""
        n = self.block.size
        nxt = np.full(n, NEVER, dtype=np.int64)
        order = np.lexsort((np.arange(n), self.block))
        same = self.block[order[1:]] == self.block[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
        return nxt


def _detect(rec: dict, path: str, lineno: int) -> str:
    for name, spec in FORMATS.items():
        if all(k in rec for k in spec["required"]):
            if name == "mooncake" and "chat_id" in rec:
                continue
            return name
    raise TraceError(f"{path}:{lineno}: unknown trace format (keys {sorted(rec)})")


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(rec: object, fmt: str, path: str, lineno: int) -> dict:
    if not isinstance(rec, dict):
        raise TraceError(f"{path}:{lineno}: expected a JSON object")
    for k in FORMATS[fmt]["required"]:
        if k not in rec:
            raise TraceError(f"{path}:{lineno}: missing field {k!r}")
    ids = rec["hash_ids"]
    if not isinstance(ids, list) or not all(_is_int(x) for x in ids):
        raise TraceError(f"{path}:{lineno}: hash_ids must be a list of integers")
    if ids and not INT64_MIN <= min(ids) <= max(ids) <= INT64_MAX:
        raise TraceError(f"{path}:{lineno}: hash_ids must fit in 64-bit signed integers")
    ts = rec["timestamp"]
    # NaN compares false with everything: it would pass both this and the backwards-time check
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not 0 <= ts <= sys.float_info.max:
        raise TraceError(f"{path}:{lineno}: timestamp must be a finite non-negative number")
    if fmt == "bailian":
        if not _is_int(rec["turn"]):
            raise TraceError(f"{path}:{lineno}: turn must be an integer")
        parent = rec.get("parent_chat_id")
        if parent is not None and not _is_int(parent):  # null or absent: no parent (as -1)
            raise TraceError(f"{path}:{lineno}: parent_chat_id must be an integer or null")
    return rec


def _read_records(path: str, progress: Optional[Callable[[int], None]] = None) -> tuple[str, list[dict]]:
    """Validated records of a JSONL trace file and its format (errors name the line)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"trace not found: {path}")
    fmt = None
    records: list[dict] = []
    last_t = -1.0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            except UnicodeDecodeError:
                raise TraceError(f"{path}:{lineno}: not UTF-8 JSON lines (compressed? decompress it first)") from None
            except RecursionError:
                raise TraceError(f"{path}:{lineno}: JSON nested too deeply for a trace record") from None
            if fmt is None:
                if not isinstance(rec, dict):
                    raise TraceError(f"{path}:{lineno}: expected a JSON object")
                fmt = _detect(rec, path, lineno)
            rec = _check(rec, fmt, path, lineno)
            t = float(rec["timestamp"]) * FORMATS[fmt]["time_scale"]
            if t < last_t:
                raise TraceError(f"{path}:{lineno}: timestamps go backwards ({t} < {last_t})")
            last_t = t
            records.append(rec)
            if progress is not None and lineno % 1000 == 0:
                progress(1000)
    if fmt is None:
        raise TraceError(f"{path}: empty trace")
    return fmt, records


def load_trace(path: str, progress: Optional[Callable[[int], None]] = None) -> Trace:
    fmt, records = _read_records(path, progress)
    return trace_from_records(os.path.basename(path), fmt, records)


def trace_from_records(name: str, fmt: str, records: list[dict]) -> Trace:
    """Flatten validated request records (in time order) into per-access arrays, with
    each access's block class computed causally from the requests before it."""
    blocks: list[int] = []
    times: list[float] = []
    classes: list[int] = []
    reqs: list[int] = []
    seen: set[int] = set()
    scale = FORMATS[fmt]["time_scale"]
    for n_req, rec in enumerate(records):
        t = float(rec["timestamp"]) * scale
        ids = rec["hash_ids"]
        n = len(ids)
        if fmt == "bailian":
            parent = rec.get("parent_chat_id")
            cont = int(rec.get("turn", 1)) > 1 or (parent is not None and int(parent) >= 0)
        else:
            cont = n > 1 and ids[1] in seen
        new = sum(1 for x in ids if x not in seen)
        for i, x in enumerate(ids):
            blocks.append(x)
            times.append(t)
            classes.append(block_class(i == n - 1, cont, new))
            reqs.append(n_req)
        seen.update(ids)
    if not records:
        raise TraceError(f"{name}: empty trace")
    if not blocks:  # every request's hash_ids empty: nothing to replay (a division by zero later)
        raise TraceError(f"{name}: no request names a block (every hash_ids is empty)")
    raw = np.asarray(blocks, dtype=np.int64)
    uniq, dense = np.unique(raw, return_inverse=True)
    return Trace(name, fmt, dense.astype(np.int64), np.asarray(times), np.asarray(classes, np.int64),
                 np.asarray(reqs, np.int64), len(records), int(uniq.size))


def split_trace(trace: Trace, part: str) -> Trace:
    """The first or second half of a trace by requests (``part`` = "first" | "second" | "all"):
    tune on one half, report on the other. Classes keep the whole trace's causal history."""
    if part == "all":
        return trace
    if part not in ("first", "second"):
        raise ValueError(f"part must be first, second or all, not {part!r}")
    half = trace.n_requests // 2
    keep = trace.request < half if part == "first" else trace.request >= half
    if not keep.any():
        raise TraceError(f"{trace.name}: the {part} half of its {trace.n_requests} requests has no accesses")
    uniq, dense = np.unique(trace.block[keep], return_inverse=True)
    req = trace.request[keep]
    return Trace(f"{trace.name}[{part} half]", trace.format, dense.astype(np.int64), trace.time_s[keep],
                 trace.cls[keep], req - req.min(), int(np.unique(req).size), int(uniq.size))
