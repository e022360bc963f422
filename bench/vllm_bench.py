"""vLLM alone vs vLLM with its own CPU offloading vs vLLM on kvtier: same workload, same KV space.

Each configuration is one engine in a process of its own (``vllm_run``), run one
after the other on one random-weight Llama: a multi-turn, multi-session chat
whose prefixes need about four times the vLLM KV blocks given, so they fall out of
vLLM and either are recomputed (vLLM alone) or come back from kvtier's DRAM and
NVMe. A reference engine with ample KV (every prefix stays in vLLM's own cache)
gives the tokens and logprobs each request must match bit for bit (it carries the
connector too, attached to a daemon that never serves a block: on the CPU backend
vLLM with a connector rounds some decode logprobs differently than without one),
and a run without prefix caching the agreement with full recomputation. vLLM's offloading
connectors are started too; where one cannot run on this backend, the reason it
gave is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from kvtier.bench.args import positive_int
from kvtier.bench.spawn import DaemonProcess
from kvtier.bench.vllm_run import MODELS, make_model

BLOCK_TOKENS = 128  # vLLM's CPU backend default
OFFLOADERS = {
    "OffloadingConnector": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}},
    "SimpleCPUOffloadConnector": {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=sorted(MODELS), default="bench", help="random-weight Llama size")
    p.add_argument("--sessions", type=positive_int, default=8)
    p.add_argument("--turns", type=positive_int, default=4)
    p.add_argument("--blocks", type=positive_int, default=9, help="vLLM KV blocks for the compared runs (about a quarter)")
    p.add_argument("--skip-offload", action="store_true", help="do not start vLLM's offloading connectors")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs, per-run JSON)")


def kvtier_config(runtime_dir: str) -> str:
    return json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.connectors.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": {"runtime_dir": runtime_dir}})


def engine_run(root: Path, name: str, model: Path, args: argparse.Namespace, blocks: int, kv: str = "",
               extra: tuple[str, ...] = ()) -> tuple[Optional[dict], str]:
    """(results, "") or (None, the engine's own error line)."""
    out, log = root / f"{name}.json", root / f"{name}.log"
    cmd = [sys.executable, "-m", "kvtier.bench.vllm_run", "--model-dir", str(model), "--blocks", str(blocks),
           "--sessions", str(args.sessions), "--turns", str(args.turns), "--out", str(out), *extra]
    if kv:
        cmd += ["--kv-transfer-config", kv]
    with open(log, "w") as fh:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    if rc == 0 and out.exists():
        return json.loads(out.read_text()), ""
    return None, failure_reason(log.read_text())


def failure_reason(text: str) -> str:
    """The last exception line the engine logged (the root cause, not the wrapper's)."""
    lines = [ln.split("] ", 1)[-1].strip() for ln in text.splitlines()]
    errs = [ln for ln in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", ln)
            and "Engine core initialization failed" not in ln]
    return errs[0][:500] if errs else (lines[-1][:500] if lines else "no output")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else 0.0


def summary(r: dict) -> dict:
    reqs = r["requests"]
    ttft = [x["ttft_s"] for x in reqs]
    return {"prefill_tokens": sum(x["prompt_tokens"] - x["cached_tokens"] for x in reqs),
            "cached_tokens": sum(x["cached_tokens"] for x in reqs), "ttft_p50_s": _pct(ttft, 0.5),
            "ttft_p99_s": _pct(ttft, 0.99), "total_s": r["total_s"], "engine_start_s": r["start_s"]}


def loads_by_mode(r: dict) -> dict[str, int]:
    """Tokens kvtier loaded in the forward (sync: staging/DRAM) and between steps (async: NVMe)."""
    out = {"sync": 0, "async": 0, "failed": 0}
    for x in r["requests"]:
        kv = x.get("kvtier") or {}
        if kv.get("load"):
            out[kv["load"]] += int(kv["loaded_tokens"])
        out["failed"] += int(kv.get("failed_tokens", 0))
    return out


def same(a: dict, b: dict) -> bool:
    return all(x["tokens"] == y["tokens"] and x["logprobs"] == y["logprobs"]
               for x, y in zip(a["requests"], b["requests"])) and len(a["requests"]) == len(b["requests"])


def token_agreement(a: dict, b: dict) -> float:
    pairs = [(p, q) for x, y in zip(a["requests"], b["requests"]) for p, q in zip(x["tokens"], y["tokens"])]
    return sum(p == q for p, q in pairs) / len(pairs) if pairs else 1.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    try:
        return _run(root, args)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root}")


def _run(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    m = MODELS[args.model]
    model = make_model(root / "model", args.model)
    head_dim = m["hidden_size"] // m["num_attention_heads"]
    block = m["num_hidden_layers"] * (2 * BLOCK_TOKENS * m["num_key_value_heads"] * head_dim * 4 + 64)
    stride = -(-block // 4096) * 4096
    out: dict[str, Any] = {"model": {"name": args.model, **m, "dtype": "float32", "kv_bytes_per_block": block},
                           "workload": {"sessions": args.sessions, "turns": args.turns, "vllm_kv_blocks": args.blocks,
                                        "block_tokens": BLOCK_TOKENS}}
    runs: dict[str, dict] = {}
    print("reference (ample KV, the connector attached to a daemon that serves nothing) ...", flush=True)
    (root / "refdaemon").mkdir()
    rd = DaemonProcess(root / "refdaemon", f"tiers.hbm_bytes={64 * stride}", "tiers.dram_bytes=0", "tiers.nvme_bytes=0")
    try:
        ref, why = engine_run(root, "reference", model, args, 8 * args.blocks, kvtier_config(str(rd.runtime_dir)))
    finally:
        rd.stop()
    if ref is None:
        raise RuntimeError(f"the reference vLLM run failed: {why}")
    print("vLLM alone ...", flush=True)
    alone, why = engine_run(root, "alone", model, args, args.blocks)
    if alone is None:
        raise RuntimeError(f"vLLM alone failed: {why}")
    runs["vllm"] = summary(alone)
    offload: dict[str, Any] = {}
    for name, cfg in ({} if args.skip_offload else OFFLOADERS).items():
        print(f"vLLM + {name} ...", flush=True)
        res, why = engine_run(root, name, model, args, args.blocks, json.dumps(cfg))
        offload[name] = {"ran": res is not None, "reason": why or None, **(summary(res) if res else {})}
        if res:
            runs[name] = summary(res)
            offload[name]["bit_exact"] = same(res, ref)
    print("vLLM + kvtier ...", flush=True)
    droot = root / "daemon"
    droot.mkdir()
    d = DaemonProcess(droot, f"tiers.hbm_bytes={24 * stride}", f"tiers.dram_bytes={12 * stride}",
                      f"tiers.nvme_bytes={256 * (stride + 4096)}")
    try:
        kvt, why = engine_run(root, "kvtier", model, args, args.blocks, kvtier_config(str(d.runtime_dir)),
                              ("--runtime-dir", str(d.runtime_dir)))
    finally:
        d.stop()
    if kvt is None:
        raise RuntimeError(f"vLLM + kvtier failed: {why}")
    runs["kvtier"] = summary(kvt)
    svc = kvt["daemon"]["end"]["service"]
    runs["kvtier"]["hit_blocks_by_tier"] = {t: int(svc.get(f"hits_{t}", 0)) for t in ("hbm", "dram", "nvme")}
    runs["kvtier"]["hit_tokens_by_tier"] = {t: BLOCK_TOKENS * n for t, n in runs["kvtier"]["hit_blocks_by_tier"].items()}
    runs["kvtier"]["loaded_tokens_by_mode"] = loads_by_mode(kvt)
    print("vLLM without prefix reuse ...", flush=True)
    norec, _ = engine_run(root, "no_prefix_cache", model, args, 8 * args.blocks, extra=("--no-prefix-caching",))
    v, k = runs["vllm"], runs["kvtier"]
    ran = [n for n, o in offload.items() if o["ran"]]
    best_offload = min((runs[n]["ttft_p50_s"] for n in ran), default=None)
    out |= {
        "runs": runs, "offload": offload,
        "bit_exact": same(kvt, ref),
        # vLLM without any connector rounds some decode logprobs differently on this backend (tokens equal)
        "logprobs_equal_vllm_alone": same(alone, kvt), "token_agreement_vs_vllm_alone": token_agreement(kvt, alone),
        "cached_tokens_equal_reference": [x["cached_tokens"] for x in kvt["requests"]] ==
                                         [x["cached_tokens"] for x in ref["requests"]],
        "token_agreement_vs_no_prefix_reuse": token_agreement(kvt, norec) if norec else None,
        "prefill_tokens_ratio_vs_vllm": k["prefill_tokens"] / v["prefill_tokens"] if v["prefill_tokens"] else None,
        "ttft_p50_ratio_vs_vllm": k["ttft_p50_s"] / v["ttft_p50_s"] if v["ttft_p50_s"] else None,
        "ttft_p50_ratio_vs_offload": k["ttft_p50_s"] / best_offload if best_offload else None,
        "offload_unavailable_reason": None if ran else
            "; ".join(f"{n}: {o['reason']}" for n, o in offload.items()) or "not started (--skip-offload)",
        "total_time_ratio_vs_vllm": k["total_s"] / v["total_s"] if v["total_s"] else None,
        "targets": {"prefill_tokens_ratio_max": 0.5, "ttft_p50_ratio_max": 0.8},
    }
    out["ok"] = bool(out["bit_exact"] and (out["prefill_tokens_ratio_vs_vllm"] or 1) <= 0.5
                     and (out["ttft_p50_ratio_vs_vllm"] or 9) <= 0.8)
    print(json.dumps({k2: out[k2] for k2 in ("bit_exact", "prefill_tokens_ratio_vs_vllm", "ttft_p50_ratio_vs_vllm",
                                              "ttft_p50_ratio_vs_offload", "offload_unavailable_reason", "ok")}, indent=1))
    return out
