"""One HBM region a daemon: a later engine that brings a region of its own must bring that
one, and one that brings none must be able to map the daemon's (refs-only engines map
nothing). A register refused so changes nothing: no session, no block."""

from __future__ import annotations

from types import SimpleNamespace

import msgpack
import pytest

from kvtier.daemon.node import Node
from kvtier.protocol import wire as P
from kvtier.protocol.cuda_ipc import region_identity
from kvtier.protocol.wire import ProtocolError

from .service_calls import call, hbm_only_service, ids


def _handle(memory: bytes, ref_counter: bytes = b"rc0") -> bytes:
    """A CUDA IPC handle as ``export_handle`` packs it: device, offset, length, and torch's 8
    share fields (the allocation's handle, size, offset, then the per-export counter and event)."""
    return msgpack.packb([0, 0, 8 * 4096, [0, memory, 8 * 4096, 0, ref_counter, 0, b"event", False]],
                         use_bin_type=True)


def test_a_second_engine_with_another_region_is_refused_and_changes_nothing(tmp_path):
    svc = hbm_only_service(tmp_path, 8)
    try:
        a = call(svc, "register", "A", pid=1, block_bytes=4096)
        own = dict(pid=2, block_bytes=4096, hbm_slots=8)
        refused = [dict(hbm_kind="shm", hbm_name="another_engines_region"),
                   dict(hbm_kind="cuda_ipc", hbm_handle=_handle(b"an engine's own device memory")),
                   dict(hbm_kind="cuda_ipc", hbm_handle=b"\x00" * 64)]  # malformed: refused, not a crash
        for region in refused:
            before = svc.stats()["engines"]
            with pytest.raises(ProtocolError) as e:
                call(svc, "register", "B", **own, **region)
            assert e.value.code == P.CONFLICT and "another HBM region" in e.value.message
            assert svc.stats()["engines"] == before and "B" not in svc.engines
        # before the check, B's cuda_ipc register was accepted and B's seals indexed the daemon's bytes
        same = call(svc, "register", "B", **own, hbm_kind="shm", hbm_name=a["hbm_name"])  # the daemon's own: fine
        assert same["hbm_name"] == a["hbm_name"]
        assert ids(call(svc, "alloc", "B", n=1)["blocks"]) != []
    finally:
        svc.close()


def _node_on(info: dict, engine_region: tuple = ()) -> SimpleNamespace:
    """What ``Node.region_conflict`` reads of a node: its region's ``hbm_info`` and the identity of
    the engine region it was built on (a node on an engine's CUDA memory needs a GPU to build)."""
    return SimpleNamespace(hbm_info=lambda: info, engine_region=engine_region)


def _args(kind: str, refs_only: bool = False, **region) -> SimpleNamespace:
    return SimpleNamespace(hbm_kind=kind, refs_only=refs_only, hbm_name=region.get("hbm_name", ""),
                           hbm_handle=region.get("hbm_handle", b""))


def test_a_node_on_an_engines_cuda_region_takes_that_region_again_and_no_other():
    first = _handle(b"engine A's KV", ref_counter=b"rc1")
    node = _node_on({"hbm_kind": "cuda", "hbm_name": "", "hbm_handle": b""}, region_identity(first))
    conflict = Node.region_conflict
    # the same tensor exported again (its reference counter and event differ per export): accepted
    assert conflict(node, _args("cuda_ipc", hbm_handle=_handle(b"engine A's KV", ref_counter=b"rc2"))) == ""
    assert "another HBM region" in conflict(node, _args("cuda_ipc", hbm_handle=_handle(b"engine B's KV")))
    assert "another HBM region" in conflict(node, _args("shm", hbm_name="a_region"))
    assert "cannot hand on" in conflict(node, _args("daemon"))  # it could map nothing
    assert conflict(node, _args("daemon", refs_only=True)) == ""  # a scheduler maps no slot
    daemons_own = _node_on({"hbm_kind": "cuda", "hbm_name": "", "hbm_handle": b"its own pool"})
    assert conflict(daemons_own, _args("daemon")) == ""
    assert "another HBM region" in conflict(daemons_own, _args("cuda_ipc", hbm_handle=first))
