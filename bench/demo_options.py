"""The demo's presets and options: model sizes, workloads, ``DemoOptions``.

Apart from the model and the runners (``workload.py``, ``demo.py``, which import
torch and transformers) so that ``kvtier demo --help`` and a bad flag answer at
once: the parser's choices and defaults come from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch

MODEL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=512),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, vocab_size=2048),
    # KV-heavy for its compute (32 KiB of KV per token, 512 KiB blocks of 16 tokens): a node-scale
    # cache of GiBs is built in minutes on a CPU, as a big model's would be on a GPU
    "node": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=8, head_dim=64, vocab_size=2048),
}


@dataclass
class Workload:
    sessions: int = 12
    turns: int = 3
    system_tokens: int = 64
    user_tokens: int = 32
    gen_tokens: int = 16
    seed: int = 0
    vocab: int = 512

    def system_prompt(self) -> "torch.Tensor":
        import torch

        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, self.vocab, (1, self.system_tokens), generator=g)

    def user_turn(self, session: int, turn: int) -> "torch.Tensor":
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + session * 1009 + turn + 1)
        return torch.randint(0, self.vocab, (1, self.user_tokens), generator=g)

    def total_tokens(self) -> int:
        return self.system_tokens + self.sessions * self.turns * (self.user_tokens + self.gen_tokens)


@dataclass
class DemoOptions(Workload):
    """The workload plus how the demo runs it (``vocab`` is taken from the model)."""

    model: str = "tiny"
    budget: float = 0.25
    block_tokens: int = 16
    hints: bool = True
    policy: str = "kvtier"
    workdir: Optional[str] = None
    dram: bool = True  # False: no DRAM tier, idle sessions go straight to NVMe
    io_backend: str = "posix"
    dram_budget: Optional[float] = None  # DRAM slots as a fraction of the workload's KV (None: half of HBM's)
    workload: str = "demo"


# --workload presets: "node" is at least 1 GiB of KV in 512 KiB blocks, HBM and DRAM 25% each, the rest on NVMe
WORKLOADS: dict[str, dict[str, Any]] = {
    "demo": {},
    "node": dict(model="node", sessions=24, turns=3, system_tokens=512, user_tokens=512, gen_tokens=16,
                 budget=0.25, dram_budget=0.25),
}


__all__ = ["MODEL_SIZES", "WORKLOADS", "Workload", "DemoOptions"]
