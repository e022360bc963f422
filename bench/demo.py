"""The end-to-end run behind ``kvtier demo`` and ``kvtier bench e2e``.

Starts a daemon process with an HBM budget of a fraction of the workload's KV
(so sessions spill to DRAM and NVMe between turns), runs every turn on the
untiered engine and on the tiered engine, compares them bit for bit, and
gathers the daemon's view (tiers, hits, moves, prefetch, stalls).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from kvtier.bench.demo_options import DemoOptions, Workload
from kvtier.bench.spawn import DaemonProcess
from kvtier.bench.workload import Comparison, ReferenceRunner, TieredRunner, TurnResult, build_model
from kvtier.client.hf_cache import KVLayout


def plan_tiers(opts: DemoOptions, layout: KVLayout) -> dict[str, int]:
    """Slots per tier: HBM = budget x the workload's blocks (at least one session's working set + headroom)."""
    T = opts.block_tokens
    per_session = math.ceil((opts.system_tokens + opts.turns * (opts.user_tokens + opts.gen_tokens)) / T)
    total = math.ceil(opts.system_tokens / T) + opts.sessions * (per_session - opts.system_tokens // T)
    want = max(1, round(opts.budget * total))
    hbm = max(want, per_session + 2)
    dram = max(2, hbm // 2) if opts.dram_budget is None else max(2, round(opts.dram_budget * total))
    return {"total_blocks": total, "hbm_blocks": hbm, "hbm_raised": int(hbm > want),
            "dram_blocks": dram, "nvme_blocks": 2 * total + 16, "session_blocks": per_session}


def check_policy(name: str) -> None:
    """Refuse an unknown policy before a model is built and a daemon started (it would refuse it)."""
    from pydantic import ValidationError

    from kvtier.daemon.config import PolicyConfig

    try:
        PolicyConfig(name=name)
    except ValidationError as e:
        raise ValueError(f"--policy: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None


def run_demo(opts: DemoOptions, progress: Callable[[int, int, str], None] = lambda done, total, what: None,
             keep: bool = False, env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Run the demo; its temp directory (sockets, NVMe slabs, log) is removed unless ``keep``
    leaves the daemon running in it. A ``workdir`` of the caller's is never removed."""
    check_policy(opts.policy)
    # One compute thread for the engine (both runs): on a real node the engine computes on
    # the GPU and the daemon's movers use host cores; on a small CPU box they must not fight.
    torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) // 2)))
    model = build_model(opts.model, opts.seed)
    layout = KVLayout.from_config(model.config, opts.block_tokens, torch.float32)
    plan = plan_tiers(opts, layout)
    root = Path(opts.workdir or tempfile.mkdtemp(prefix="kvtier-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        run = _run(opts, model, layout, plan, root, progress, keep, env)
    finally:
        if not keep and opts.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    stats, cmp = run.stats, run.cmp
    svc = stats.get("service", {})
    return {
        "options": asdict(opts), "plan": plan, "block_bytes": layout.block_bytes,
        "kv_bytes": plan["total_blocks"] * layout.block_bytes,
        "bit_exact": cmp.bit_exact, "turns_checked": cmp.turns, "steps_checked": cmp.steps,
        "mismatched_turns": cmp.mismatched_turns, **turn_figures(run.turns),
        "prefetch_on_time": stats.get("prefetch_on_time_ratio"), "stall_s": stats.get("acquire_stall_s_total", 0.0),
        "acquires": svc.get("acquires", 0), "tiers": stats.get("tiers", []), "paths": stats.get("paths", {}),
        "prefetch": stats.get("prefetch", {}), "remote": stats.get("remote", {"enabled": False}),
        "calibration": stats.get("calibration", {}), "segments": stats.get("segments", {}),
        "importance_mean": stats.get("importance_mean", 0.0), "daemon": {"runtime_dir": run.runtime_dir, "pid": run.pid,
                                                                 "kept": keep},
    }


def _sum(turns: list[tuple[TurnResult, TurnResult]], engine: int, name: str) -> float:
    return float(sum(getattr(pair[engine], name) for pair in turns))


def turn_figures(turns: list[tuple[TurnResult, TurnResult]]) -> dict[str, Any]:
    """Whole-turn, prefill and decode throughput of both engines and their ratios (same
    tokens on both sides, so a ratio of throughputs is a ratio of times), and TTFT per turn."""
    out: dict[str, Any] = {}
    decode = _sum(turns, 0, "decode_tokens")
    prefill = _sum(turns, 0, "prefill_tokens")
    whole = prefill + decode + len(turns)  # the prompt, then every token generated (the first by the prefill)
    for i, side in enumerate(("untiered", "tiered")):
        out[f"tokens_per_s_{side}"] = whole / max(_sum(turns, i, "total_s"), 1e-12)
        out[f"prefill_tokens_per_s_{side}"] = prefill / max(_sum(turns, i, "prefill_s"), 1e-12)
        out[f"decode_tokens_per_s_{side}"] = decode / max(_sum(turns, i, "forward_s"), 1e-12)
        ttft = np.array([pair[i].ttft_s for pair in turns])
        out[f"ttft_s_{side}"] = {"per_turn": ttft.tolist(), "p50": float(np.median(ttft)) if ttft.size else 0.0,
                                 "max": float(ttft.max()) if ttft.size else 0.0}
    ratio = lambda name: _sum(turns, 0, name) / max(_sum(turns, 1, name), 1e-12)
    out |= {"ratio": ratio("total_s"), "decode_ratio": ratio("forward_s"), "prefill_ratio": ratio("prefill_s"),
            "turn_tokens": whole, "prefill_tokens": prefill, "decode_tokens": decode,
            "seconds": {side: {k: _sum(turns, i, k) for k in ("total_s", "prefill_s", "forward_s")}
                        for i, side in enumerate(("untiered", "tiered"))}}
    # what the tiered turn spends outside the two engines' shared compute: the step that costs
    out["overhead_s"] = {k: out["seconds"]["tiered"][k] - out["seconds"]["untiered"][k]
                         for k in ("total_s", "prefill_s", "forward_s")}
    out["overhead_s"]["outside_forward_s"] = out["overhead_s"]["total_s"] - out["overhead_s"]["prefill_s"] - \
        out["overhead_s"]["forward_s"]
    return out


@dataclass
class _Run:
    """What the turns produced: the comparison, both engines' turn clocks, the daemon's final stats."""

    stats: dict[str, Any]
    cmp: Comparison
    turns: list[tuple[TurnResult, TurnResult]]
    runtime_dir: str
    pid: int


def _run(opts: DemoOptions, model: Any, layout: KVLayout, plan: dict[str, int], root: Path,
         progress: Callable[[int, int, str], None], keep: bool, env: Optional[dict[str, str]]) -> _Run:
    """Both engines through every turn against a daemon started in ``root``."""
    stride = layout.block_bytes + (-layout.block_bytes) % 4096
    dram = plan["dram_blocks"] * stride if opts.dram else 0
    daemon = DaemonProcess(root, f"tiers.hbm_bytes={plan['hbm_blocks'] * stride}", f"tiers.dram_bytes={dram}",
                           f"tiers.nvme_bytes={plan['nvme_blocks'] * stride}", f'policy.name="{opts.policy}"',
                           f'tiers.io_backend="{opts.io_backend}"', env=env)
    wl = Workload(**{f.name: getattr(opts, f.name) for f in fields(Workload)} | {"vocab": model.config.vocab_size})
    cmp = Comparison()
    turns: list[tuple[TurnResult, TurnResult]] = []
    client = daemon.client(engine_id="demo-engine", heartbeat_s=1.0)
    try:
        client.register(block_bytes=layout.block_bytes, block_tokens=layout.block_tokens, layout=layout.describe())
        reference, tiered = ReferenceRunner(model), TieredRunner(model, client, layout)
        system = wl.system_prompt()
        reference.prefill_system(system)
        tiered.prefill_system(system)
        schedule = [(s, t) for t in range(opts.turns) for s in range(opts.sessions)]
        n = len(schedule)
        # two passes: the untiered engine's turns, then the tiered engine's back to back, as an
        # engine runs them. Interleaved, the daemon's background work (prefetch, demotion) had the
        # reference turn's time between two tiered turns, and the hints' deadlines counted it.
        refs = []
        for i, (s, t) in enumerate(schedule):
            progress(i, 2 * n, f"untiered: session {s} turn {t}")
            refs.append(reference.turn(s, wl.user_turn(s, t), opts.gen_tokens))
        step_s = 0.05  # the last tiered step's wall time (none yet)
        for i, (s, t) in enumerate(schedule):
            progress(n + i, 2 * n, f"tiered: session {s} turn {t}")
            t0 = time.perf_counter()
            if opts.hints and i + 1 < n:  # the engine knows its schedule: tell the daemon
                # when: the next session's acquire comes after this step; the daemon protects
                # hinted blocks only that long (plus a grace), so a deadline that is too early
                # lets them be demoted again first
                tiered.cache(schedule[i + 1][0]).hint(deadline_s=step_s)
            hint_s = time.perf_counter() - t0
            got = tiered.turn(s, wl.user_turn(s, t), opts.gen_tokens)
            got.total_s += hint_s  # the hint is the tiered engine's work too
            cmp.check(s, t, refs[i], got)
            turns.append((refs[i], got))
            step_s = time.perf_counter() - t0
        progress(2 * n, 2 * n, "done")
        time.sleep(1.1)  # one stats snapshot period, so the exporter shows the end state too
        stats = client.stats()
        client.check()
        if not keep:
            tiered.close()
    finally:
        if not keep:
            client.close()
            daemon.stop()
    return _Run(stats, cmp, turns, str(daemon.runtime_dir), daemon.proc.pid)


__all__ = ["DemoOptions", "check_policy", "run_demo", "plan_tiers"]
