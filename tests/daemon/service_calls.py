"""Driving a ``Service`` in process: one request through the real decoder, and packed ids back."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.daemon.config import load_config
from kvtier.daemon.service import Service
from kvtier.protocol import wire as P


class Clock:
    """A settable clock for ``Service(clock=...)``: tests move time by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def hbm_only_service(tmp_path: Any, hbm_blocks: int, *overrides: str, block_bytes: int = 4096) -> Service:
    """An in-process ``Service`` whose only tier is an HBM of ``hbm_blocks`` blocks (no metrics port)."""
    return Service(load_config(environ={}, overrides=[
        f"tiers.hbm_bytes={hbm_blocks * block_bytes}", "tiers.dram_bytes=0", "tiers.nvme_bytes=0",
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false", *overrides]))


def pump(s: Service, rounds: int = 3) -> None:
    """Run the owner loop's background turns until the moves they start have landed."""
    for _ in range(rounds):
        s.node.mgr.wait(timeout=10)
        s.background()
        s.advance()
        s.maintain()
    s.node.mgr.wait(timeout=10)
    s.background()


def call(svc: Service, op: str, engine: str = "e", **args: Any) -> Any:
    """Encode, decode and handle one request exactly as the server would."""
    req, a = P.decode_request(P.pack({"v": 1, "id": 1, "op": op, "engine": engine, "args": args}), 1 << 20)
    return svc.handle(req, a)


def ids(b: bytes) -> list[int]:
    return np.frombuffer(b, dtype="<i8").tolist()
