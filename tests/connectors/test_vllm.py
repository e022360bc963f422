"""vLLM on kvtier, against the real vLLM (the CPU build): bit-exact, with prefixes that fell
out of vLLM's KV coming back from kvtier's DRAM and NVMe, and corrupted NVMe copies refused.

Two engines for the whole module (each start is ~20 s or more): a reference with ample KV,
whose own prefix cache holds every prefix, and vLLM with 9 KV blocks (about a quarter of
the sessions' prefixes) on kvtier. The reference has the connector attached too (to a
daemon of its own that never serves a block): on this CPU backend, vLLM with any KV
connector rounds some decode logprobs differently (by an ulp or so, tokens equal) than
without one, even on a cold cache, so the like-for-like reference carries one. Both run
the same 8 sessions x 4 turns; before the last turn every NVMe copy in the daemon's slabs
is corrupted, so that turn's NVMe loads must fail their checksum and be recomputed. Prefixes
with a block on NVMe take vLLM's async-load path, the others the layer-wise one in the
forward; each request's ``kv_transfer_params`` says which it took.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from kvtier.bench.spawn import DaemonProcess  # noqa: E402
from kvtier.bench.vllm_bench import kvtier_config  # noqa: E402
from kvtier.bench.vllm_run import make_model  # noqa: E402

TURNS, DRILL = 4, 3
BLOCK = 4 * (2 * 128 * 2 * 64 * 4 + 64)  # the tiny model's kvtier block: 4 layers of K/V + hash trailer
STRIDE = -(-BLOCK // 4096) * 4096


def _engine(root: Path, name: str, model: Path, blocks: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvtier.bench.vllm_run", "--model-dir", str(model), "--blocks", str(blocks),
           "--turns", str(TURNS), "--out", str(root / f"{name}.json"), *extra]
    log = open(root / f"{name}.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})


def _result(root: Path, name: str, p: subprocess.Popen) -> dict:
    rc = p.wait(timeout=900)
    if rc != 0:
        tail = (root / f"{name}.log").read_text()[-3000:]
        raise AssertionError(f"{name} engine exited {rc}:\n{tail}")
    return json.loads((root / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    model = make_model(root / "model", "tiny")
    (root / "daemon").mkdir()
    (root / "refdaemon").mkdir()
    # LRU admits every HBM victim into DRAM. A staging pool of 6 slots (one load and one save fit)
    # and 12 DRAM slots: a session's last turn (~10 blocks back) is in DRAM, older turns on NVMe
    d = DaemonProcess(root / "daemon", f"tiers.hbm_bytes={6 * STRIDE}", f"tiers.dram_bytes={12 * STRIDE}",
                      f"tiers.nvme_bytes={128 * (STRIDE + 4096)}", 'policy.name="lru"')
    rd = DaemonProcess(root / "refdaemon", f"tiers.hbm_bytes={64 * STRIDE}", "tiers.dram_bytes=0", "tiers.nvme_bytes=0")
    try:
        ref = _engine(root, "reference", model, 64, "--kv-transfer-config", kvtier_config(str(rd.runtime_dir)),
                      "--runtime-dir", str(rd.runtime_dir))
        kvt = _engine(root, "kvtier", model, 9, "--kv-transfer-config", kvtier_config(str(d.runtime_dir)),
                      "--runtime-dir", str(d.runtime_dir), "--nvme-dir", str(d.nvme_dir),
                      "--corrupt-before-turn", str(DRILL))
        yield _result(root, "reference", ref), _result(root, "kvtier", kvt)
    finally:
        d.stop()
        rd.stop()


def _lp(row: dict) -> torch.Tensor:
    return torch.tensor([float.fromhex(x) for x in row["logprobs"]], dtype=torch.float64)


def test_every_request_is_bit_exact_against_the_reference(runs):
    ref, kvt = runs
    assert ref["daemon"]["end"]["service"].get("acquires", 0) == 0  # every reference hit was vLLM's own cache
    assert len(kvt["requests"]) == len(ref["requests"]) == 8 * TURNS
    for a, b in zip(kvt["requests"], ref["requests"]):
        assert (a["session"], a["turn"], a["prompt_tokens"]) == (b["session"], b["turn"], b["prompt_tokens"])
        assert torch.equal(torch.tensor(a["tokens"]), torch.tensor(b["tokens"])), (a["session"], a["turn"])
        if a["turn"] < DRILL:  # served from kvtier: the bytes vLLM wrote, so the very same logprobs
            assert torch.equal(_lp(a), _lp(b)), (a["session"], a["turn"])
        else:  # the drill turn recomputed its prefixes in one prefill: equal tokens, rounding may differ
            assert torch.allclose(_lp(a), _lp(b), rtol=0, atol=1e-4), (a["session"], a["turn"])


def test_prefixes_that_fell_out_of_vllm_came_back_from_dram_and_nvme(runs):
    ref, kvt = runs
    before = [r for r in kvt["requests"] if r["turn"] < DRILL]
    # the same cached tokens as vLLM with every prefix in its own cache: the same suffix was computed
    assert [r["cached_tokens"] for r in before] == [r["cached_tokens"] for r in ref["requests"] if r["turn"] < DRILL]
    # 9 vLLM blocks cannot hold 8 sessions' histories: most of those hits were kvtier's
    assert sum(r["cached_tokens"] for r in before) > 9 * 128 * 4
    snap = kvt["daemon"]["before_corrupt"]
    svc, paths = snap["service"], snap["paths"]
    # every block kvtier served was found in one of its tiers; those in DRAM are mostly
    # prefetched into HBM before the acquire (then counted as HBM hits: 0 or 1 stayed in DRAM
    # until their acquire, by timing), so the promotions say where the prefixes came back from
    assert svc["hits_hbm"] + svc.get("hits_dram", 0) + svc.get("hits_nvme", 0) == svc["acquire_blocks"] > 0, svc
    assert svc.get("hits_nvme", 0) > 0, svc
    assert paths["dram->hbm"]["moves"] > 0 and paths["nvme->hbm"]["moves"] > 0, paths


def test_prefixes_on_nvme_took_the_async_path_and_staged_ones_the_layerwise_one(runs):
    _, kvt = runs
    before = [r["kvtier"] for r in kvt["requests"] if r["turn"] < DRILL]
    by_mode = {m: [k for k in before if k["load"] == m] for m in ("sync", "async")}
    # both paths served requests, and every one of them in full (bit-exact above, the same cached tokens)
    assert by_mode["async"] and by_mode["sync"], before
    assert all(k["loaded_tokens"] > 0 and k["failed_tokens"] == 0 for k in by_mode["async"] + by_mode["sync"])


def test_corrupted_nvme_blocks_are_refused_and_recomputed(runs):
    ref, kvt = runs
    assert kvt["daemon"]["corrupted_slots"] > 0
    def nvme_read_errors(snap: dict) -> int:
        return sum(int(v.get("errors", 0)) for k, v in snap["paths"].items() if k.startswith("nvme"))

    assert nvme_read_errors(kvt["daemon"]["before_corrupt"]) == 0
    assert nvme_read_errors(kvt["daemon"]["end"]) > 0  # the corrupted copies were read, failed, refused
    # the drill turn still matches the reference bit for bit (checked above for every request); its
    # recomputed prefixes were not served from the corrupted copies
    drill = [r for r in kvt["requests"] if r["turn"] == DRILL]
    assert all(r["tokens"] == q["tokens"] for r, q in zip(drill, [q for q in ref["requests"] if q["turn"] == DRILL]))
    # the corrupted prefixes were NVMe ones: their async loads failed, and vLLM recomputed them
    failed = [r["kvtier"] for r in drill if r["kvtier"]["failed_tokens"]]
    assert failed and all(k["load"] == "async" for k in failed), [r["kvtier"] for r in drill]


def test_connector_stats_sum_over_workers_and_intervals():
    from kvtier.connectors.vllm import KVTierConnector, KVTierStats

    a = KVTierConnector.build_kv_connector_stats({"async_loaded_blocks": 3, "saved_blocks": 1})
    assert isinstance(a, KVTierStats)
    b = KVTierStats(data={"async_loaded_blocks": 2, "save_dropped_blocks": 1})
    assert a.aggregate(b).reduce() == {"async_loaded_blocks": 5, "saved_blocks": 1, "save_dropped_blocks": 1}
    assert KVTierStats(data={"saved_blocks": 0}).is_empty() and not a.is_empty()
    a.reset()
    assert a.is_empty()


def test_decode_context_parallelism_is_refused_at_start():
    """With DCP vLLM hashes and aligns blocks of block_size x dcp tokens: loading and saving
    them as blocks of block_size loaded the wrong tokens' KV and sealed half-written blocks."""
    from types import SimpleNamespace as NS

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.connectors.vllm import KVTierConnector

    config = NS(kv_transfer_config=NS(kv_connector_extra_config={}), cache_config=NS(block_size=16),
                parallel_config=NS(decode_context_parallel_size=2))
    with pytest.raises(ValueError, match="decode context parallelism"):
        KVTierConnector(config, KVConnectorRole.SCHEDULER, None)


def test_a_cache_reset_is_refused_not_claimed():
    """After a weight update vLLM asks the connector to drop its cache; kvtier's blocks keep their
    keys under the namespace, so a claimed reset served the old weights' KV. vLLM reports a refusal."""
    from types import SimpleNamespace as NS

    from vllm.v1.core.sched.scheduler import Scheduler

    from kvtier.connectors.vllm import KVTierConnector

    connector = object.__new__(KVTierConnector)  # reset_cache reads no state
    assert connector.reset_cache() is False
    assert Scheduler.reset_connector_cache(NS(connector=connector, log_stats=False)) is False
