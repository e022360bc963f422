"""The demo's model and chat workload, run twice: untiered (DynamicCache) and tiered.

A small Llama-architecture model is built from a transformers config with a
fixed seed (no download). Sessions share a system prompt; each turn appends
user tokens and generates greedily. Both runners execute the very same
forward calls in the same order, so the tiered run must reproduce the
untiered one bit for bit: same logits (``torch.equal``), same tokens.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch

from kvtier.bench.demo_options import MODEL_SIZES, Workload
from kvtier.client.hf_cache import KVLayout, TieredCache
from kvtier.kernels.attention import MassRecorder, install_recorder, register_attention

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedModel

    from kvtier.client.tier_client import TierClient


def build_model(size: str = "tiny", seed: int = 0) -> "LlamaForCausalLM":
    """A randomly initialised Llama model (fixed seed) using kvtier's reference attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(MODEL_SIZES)}")
    name = register_attention()
    cfg = LlamaConfig(max_position_embeddings=8192, **MODEL_SIZES[size])
    cfg._attn_implementation = name
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@dataclass
class TurnResult:
    """One turn's outputs and clocks. ``forward_s`` is the decode steps' forward time;
    ``prefill_s`` the first step's (the prompt, and for the tiered engine the acquire,
    the allocation and the gather from the slots); ``total_s`` the whole turn, hooks
    and the engine's RPCs around it included; ``ttft_s`` from the turn's start to its
    first token."""

    tokens: list[int]
    logits: list[torch.Tensor]
    forward_s: float
    decode_tokens: int
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    total_s: float = 0.0
    ttft_s: float = 0.0


class ReferenceRunner:
    """The untiered engine: one DynamicCache per session, kept across turns."""

    def __init__(self, model: "PreTrainedModel") -> None:
        self.model = model
        self.caches: dict[int, object] = {}
        self.system: Optional[object] = None

    def prefill_system(self, tokens: torch.Tensor) -> None:
        from transformers import DynamicCache

        self.system = DynamicCache(config=self.model.config)
        with torch.no_grad():
            self.model(input_ids=tokens, cache=self.system)

    def _cache(self, s: int) -> object:
        if s not in self.caches:
            self.caches[s] = copy.deepcopy(self.system)
        return self.caches[s]

    def turn(self, s: int, user: torch.Tensor, gen: int) -> TurnResult:
        start = time.perf_counter()
        res = run_turn(self.model, self._cache(s), user, gen)
        res.total_s = time.perf_counter() - start  # a session's first turn copies the system prompt's cache
        return res


def run_turn(model: torch.nn.Module, cache: object, user: torch.Tensor, gen: int,
             before: Callable[[torch.Tensor], None] = lambda ids: None,
             after: Callable[[], None] = lambda: None) -> TurnResult:
    """Prefill the user tokens, then decode ``gen`` tokens greedily; logits of every step.
    Every step is timed, the first (prefill) apart from the rest (decode)."""
    out_tokens: list[int] = []
    logits: list[torch.Tensor] = []
    ids = user
    seconds = prefill = ttft = 0.0
    start = time.perf_counter()
    with torch.no_grad():
        for step in range(gen):
            before(ids)
            t0 = time.perf_counter()
            out = model(input_ids=ids, cache=cache, logits_to_keep=1)
            took = time.perf_counter() - t0
            if step:
                seconds += took
            else:
                prefill = took
            after()
            last = out.logits[:, -1]
            logits.append(last.clone())
            ids = last.argmax(-1, keepdim=True)
            out_tokens.append(int(ids))
            if not step:
                ttft = time.perf_counter() - start
    return TurnResult(out_tokens, logits, seconds, gen - 1, prefill, int(user.shape[1]),
                      time.perf_counter() - start, ttft)


class TieredRunner:
    """The kvtier engine: one TieredCache per session; idle sessions release their pins."""

    def __init__(self, model: torch.nn.Module, client: "TierClient", layout: KVLayout,
                 report_attention: bool = True) -> None:
        self.model = model
        self.client = client
        self.layout = layout
        self.caches: dict[int, TieredCache] = {}
        self.system_keys: list[int] = []
        self.system_tokens: list[int] = []
        self.system_cache: Optional[TieredCache] = None
        self.recorder = MassRecorder(layout.block_tokens) if report_attention else None
        self.namespace = b"kvtier-demo"

    def prefill_system(self, tokens: torch.Tensor) -> None:
        cache = TieredCache(self.client, self.layout, 1, self.namespace, seq_ids=[0])
        cache.segment = "system"
        cache.feed_tokens(tokens)
        with torch.no_grad():
            self.model(input_ids=tokens, cache=cache)
        cache.deactivate()
        self.system_cache = cache  # keeps a reference on the shared blocks for the whole run
        self.system_keys = list(cache.rows[0].keys)
        self.system_tokens = tokens[0].tolist()

    def cache(self, s: int) -> TieredCache:
        if s not in self.caches:
            self.caches[s] = TieredCache.from_prefix(self.client, self.layout, self.system_keys,
                                                     self.system_tokens, self.namespace, seq_id=s + 1)
        return self.caches[s]

    def _report(self, cache: TieredCache) -> None:
        if self.recorder is None:
            return
        mass = self.recorder.take()
        if mass is None:
            return
        for row, m in zip(cache.rows, mass):
            n = min(len(row.blocks), m.numel())
            self.client.report_attention(np.asarray(row.blocks[:n]), m[:n].numpy())

    @staticmethod
    def _before(cache: TieredCache, ids: torch.Tensor) -> None:
        cache.segment = "user" if ids.shape[1] > 1 else "assistant"  # prompt chunk vs decoded token
        cache.feed_tokens(ids)

    def turn(self, s: int, user: torch.Tensor, gen: int) -> TurnResult:
        start = time.perf_counter()
        cache = self.cache(s)
        install_recorder(self.model, self.recorder)
        try:
            res = run_turn(self.model, cache, user, gen, before=lambda ids: self._before(cache, ids),
                           after=lambda: self._report(cache))
        finally:
            install_recorder(self.model, None)
        cache.deactivate()
        res.total_s = time.perf_counter() - start  # the release is part of the turn
        return res

    def close(self) -> None:
        for c in self.caches.values():
            c.close()
        if self.system_cache is not None:
            self.system_cache.close()


@dataclass
class Comparison:
    turns: int = 0
    steps: int = 0
    mismatched_turns: list[tuple[int, int]] = field(default_factory=list)

    @property
    def bit_exact(self) -> bool:
        return self.turns > 0 and not self.mismatched_turns

    def check(self, session: int, turn: int, ref: TurnResult, got: TurnResult) -> bool:
        self.turns += 1
        self.steps += len(ref.logits)
        same = ref.tokens == got.tokens and len(ref.logits) == len(got.logits) and all(
            torch.equal(a, b) for a, b in zip(ref.logits, got.logits))
        if not same:
            self.mismatched_turns.append((session, turn))
        return same


__all__ = ["build_model", "Workload", "ReferenceRunner", "TieredRunner", "Comparison", "MODEL_SIZES", "run_turn"]
