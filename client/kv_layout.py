"""The block layout an engine registers (``KVLayout``), a sequence's blocks (``Row``), and the
content-chained block keys (``chain_key``, ``row_keys``) a transformers engine seals them under."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype

    @classmethod
    def from_config(cls, config: Any, block_tokens: int = 16, dtype: torch.dtype = torch.float32) -> "KVLayout":
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, heads, head_dim, block_tokens, dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_elems(self) -> int:
        return int(np.prod(self.shape))

    @property
    def block_bytes(self) -> int:
        return self.block_elems * torch.empty(0, dtype=self.dtype).element_size()

    def describe(self) -> dict:
        return {"layers": self.num_layers, "kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "dtype": str(self.dtype).replace("torch.", "")}

    def pool_view(self, hbm: torch.Tensor) -> torch.Tensor:
        """Typed ``[slots, layers, 2, heads, tokens, head_dim]`` view of the uint8 HBM pool."""
        n_slots, stride = hbm.shape
        item = torch.empty(0, dtype=self.dtype).element_size()
        flat = hbm.reshape(-1).view(self.dtype)
        L, two, H, T, D = self.shape
        return torch.as_strided(flat, (n_slots, L, two, H, T, D),
                                (stride // item, two * H * T * D, H * T * D, T * D, D, 1))


def chain_key(parent: int, payload: bytes, namespace: bytes) -> int:
    """Content-chained 64-bit block key: equal prefixes give equal keys (never 0)."""
    h = xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + namespace + payload)
    return h or 1


@dataclass
class Row:
    blocks: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # of the sealed (full) blocks
    length: int = 0
    tokens: list[int] = field(default_factory=list)  # token ids, when the runner supplies them
    known: int = 0  # positions whose token ids are known, in order: the tokens of every forward so far


def row_keys(row: Row, todo: list[int], block_tokens: int, kv_bytes: dict[int, bytes], namespace: bytes) -> list[int]:
    """Keys of ``row``'s blocks ``todo`` (the next ones to seal, in order), chained on the
    row's last key: a block in ``kv_bytes`` is keyed by its K/V bytes, any other by its
    token ids."""
    keys, parent, T = [], row.keys[-1] if row.keys else 0, block_tokens
    for j in todo:
        payload = kv_bytes[j] if j in kv_bytes else np.asarray(row.tokens[j * T: (j + 1) * T], dtype=np.int64).tobytes()
        parent = chain_key(parent, payload, namespace)
        keys.append(parent)
    return keys


__all__ = ["KVLayout", "Row", "chain_key", "row_keys"]
