"""One vLLM engine over the multi-turn workload, in a process of its own (``python -m``).

vLLM's engine core is a spawned process, so the engine is built under
``__main__`` here and the caller (``kvtier bench vllm``, the tests) reads the
JSON it writes: per request the generated token ids, their logprobs as exact
float hex strings, the cached-token count vLLM reports, the time to first
token, and what the kvtier connector did for it (its ``kv_transfer_params``).
A model is a random-weight Llama made from a transformers config with a fixed
seed (``make_model``): no download.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

from kvtier.bench.args import positive_int

MODELS: dict[str, dict[str, int]] = {  # name -> LlamaConfig fields
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2},
    # ~40M parameters: recomputing a 512-token prefix takes ~0.5 s on 2 cores; reading its KV back
    # (4 blocks of 1.5 MiB) a few milliseconds
    "bench": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 6, "num_attention_heads": 12,
              "num_key_value_heads": 4},
}
VOCAB = 512


def make_model(path: Path, name: str = "tiny") -> Path:
    """Save a random-weight Llama (seed 0) to ``path`` once; reused when it is there."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    fields: Any = MODELS[name]
    cfg = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=4096, **fields)
    model: Any = LlamaForCausalLM(cfg)
    model.to(torch.float32).save_pretrained(path)
    return path


def workload(sessions: int, turns: int, system_tokens: int, user_tokens: int, seed: int = 0) -> list[dict]:
    """Turns of chat sessions sharing a system prompt: each turn's prompt is the session's
    history (earlier prompts and answers) plus a new user message. Answers are filled in
    as the run goes, so the list holds the new user tokens only."""
    rnd = random.Random(seed)
    system = [rnd.randrange(VOCAB) for _ in range(system_tokens)]
    out = []
    for t in range(turns):
        for s in range(sessions):
            out.append({"session": s, "turn": t, "prefix": system if t == 0 else [],
                        "user": [rnd.randrange(VOCAB) for _ in range(user_tokens)]})
    return out


def corrupt_nvme(nvme_dir: str, block_bytes: int) -> int:
    """Flip one payload byte of every sealed slot in the daemon's slabs (a fault drill):
    every NVMe copy then fails its checksum. Returns how many slots were hit."""
    from kvtier.tiers.pools import round_up
    from kvtier.tiers.slab_layout import SlabLayout, slots_in_slab
    from kvtier.tiers.slot_header import MAGIC

    stride = round_up(block_bytes)
    hit = 0
    for f in sorted(Path(nvme_dir).glob("slab-*.kvt")):
        count = slots_in_slab(f.stat().st_size, stride)
        layout = SlabLayout(count, stride, max(1, count))
        with open(f, "r+b") as fh:
            for slot in range(count):
                fh.seek(layout.header_offset(slot)[1])
                if fh.read(len(MAGIC)) != MAGIC:
                    continue
                off = layout.payload_offset(slot)[1] + 1000
                fh.seek(off)
                b = fh.read(1)
                fh.seek(off)
                fh.write(bytes([b[0] ^ 0x5A]))
                hit += 1
        os.sync()
    return hit


def daemon_stats(runtime_dir: str) -> dict:
    from kvtier.client.tier_client import TierClient

    with TierClient(runtime_dir=runtime_dir, heartbeat_s=None) as c:
        s = c.stats()
    return {"service": s.get("service", {}), "tiers": s.get("tiers", []), "block_bytes": s.get("block_bytes", 0),
            "paths": s.get("paths", {})}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    kv: Optional[dict] = json.loads(args.kv_transfer_config) if args.kv_transfer_config else None
    t0 = time.perf_counter()
    llm = LLM(model=args.model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=args.max_model_len,
              enable_prefix_caching=not args.no_prefix_caching, num_gpu_blocks_override=args.blocks,
              kv_transfer_config=kv, seed=0,
              max_num_seqs=4, disable_log_stats=False, enforce_eager=not args.compile)
    start_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
    history: dict[int, list[int]] = {}
    rows = []
    t_run = time.perf_counter()
    snapshots: dict[str, Any] = {}
    for req in workload(args.sessions, args.turns, args.system_tokens, args.user_tokens):
        if args.corrupt_before_turn is not None and req["turn"] == args.corrupt_before_turn and "before_corrupt" not in snapshots:
            snapshots["before_corrupt"] = daemon_stats(args.runtime_dir)
            snapshots["corrupted_slots"] = corrupt_nvme(args.nvme_dir, snapshots["before_corrupt"]["block_bytes"])
        prompt = history.get(req["session"], req["prefix"]) + req["user"]
        t = time.perf_counter()
        prompts: Any = [{"prompt_token_ids": prompt}]
        r = llm.generate(prompts, sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t
        o: Any = r.outputs[0]
        m = getattr(r, "metrics", None)
        ttft = float(getattr(m, "first_token_latency", 0.0) or 0.0) or wall
        rows.append({"session": req["session"], "turn": req["turn"], "prompt_tokens": len(prompt),
                     "cached_tokens": int(r.num_cached_tokens or 0), "tokens": list(o.token_ids),
                     "logprobs": [float(lp[tok].logprob).hex() for lp, tok in zip(o.logprobs or [], o.token_ids)],
                     "ttft_s": ttft, "wall_s": wall, "kvtier": (r.kv_transfer_params or {}).get("kvtier")})
        history[req["session"]] = prompt + list(o.token_ids)
    total = time.perf_counter() - t_run
    if args.runtime_dir:
        snapshots["end"] = daemon_stats(args.runtime_dir)
    return {"start_s": start_s, "total_s": total, "requests": rows, "blocks": args.blocks, "daemon": snapshots}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvtier.bench.vllm_run")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--blocks", type=positive_int, required=True, help="vLLM KV blocks (num_gpu_blocks_override)")
    p.add_argument("--kv-transfer-config", default="")
    p.add_argument("--sessions", type=positive_int, default=8)
    p.add_argument("--turns", type=positive_int, default=3)
    p.add_argument("--system-tokens", type=positive_int, default=256)
    p.add_argument("--user-tokens", type=positive_int, default=140)
    p.add_argument("--output-tokens", type=positive_int, default=8)
    p.add_argument("--max-model-len", type=positive_int, default=1024)
    p.add_argument("--runtime-dir", default="", help="the kvtier daemon's (for its stats)")
    p.add_argument("--nvme-dir", default="")
    p.add_argument("--corrupt-before-turn", type=positive_int, default=None, help="fault drill: corrupt every NVMe copy first")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (slower start; a connector's "
                   "layer hooks split the graph, so compiled runs with and without one may round differently)")
    p.add_argument("--no-prefix-caching", action="store_true", help="recompute every prompt in full")
    p.add_argument("--out", required=True)
    return p


if __name__ == "__main__":
    a = parser().parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    res = run(a)
    Path(a.out).write_text(json.dumps(res))
    sys.exit(0)
