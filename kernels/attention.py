"""Attention that also returns the attention mass each KV block received.

``block_mass_attention`` is the torch reference: the same arithmetic as
transformers' eager attention (matmul, additive mask, float32 softmax,
matmul), so a model run with it produces the same bits whether its K/V come
from a ``DynamicCache`` or from kvtier's paged slots. The per-block mass (the
attention probability summed over heads and queries, per ``block_tokens``
keys) is the importance telemetry the daemon's scoring consumes.

``register_attention()`` installs it in transformers' attention registry as
``"kvtier"``; ``MassRecorder`` collects the mass of one forward pass. CUDA or
Triton paged kernels can register under the same name where a GPU exists;
the reference stays the definition of correct.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, H_kv, S, D] -> [B, H_kv * groups, S, D] (grouped-query attention)."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)


def block_mass(probs: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """Attention mass per KV block: probs [B, H, Q, S] -> [B, ceil(S / block_tokens)] (float32)."""
    per_key = probs.float().sum(dim=(1, 2))  # [B, S]
    b, s = per_key.shape
    n_blocks = -(-s // block_tokens)
    pad = n_blocks * block_tokens - s
    if pad:
        per_key = torch.nn.functional.pad(per_key, (0, pad))
    return per_key.view(b, n_blocks, block_tokens).sum(dim=-1)


def block_mass_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Optional[torch.Tensor], scaling: float, groups: int,
                         block_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Returns (output [B, Q, H, D], probs [B, H, Q, S], mass [B, n_blocks] or None)."""
    k = repeat_kv(key, groups)
    v = repeat_kv(value, groups)
    weights = torch.matmul(query, k.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    probs = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).contiguous()
    mass = block_mass(probs, block_tokens) if block_tokens else None
    return out, probs, mass


class MassRecorder:
    """Sums per-block attention mass over the layers of one forward pass."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.mass: Optional[torch.Tensor] = None

    def add(self, mass: torch.Tensor) -> None:
        if self.mass is None or self.mass.shape != mass.shape:
            self.mass = mass.clone()
        else:
            self.mass += mass

    def take(self) -> Optional[torch.Tensor]:
        m, self.mass = self.mass, None
        return m


def _kvtier_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], scaling: float, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if dropout and module.training:
        raise ValueError("kvtier attention is for inference: dropout must be 0")
    recorder: Optional[MassRecorder] = getattr(module, "kvtier_recorder", None)
    tokens = recorder.block_tokens if recorder is not None else 0
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out, probs, mass = block_mass_attention(query, key, value, attention_mask, scaling,
                                            module.num_key_value_groups, tokens)
    if recorder is not None and mass is not None:
        recorder.add(mass)
    return out, probs


def register_attention(name: str = "kvtier") -> str:
    """Register the reference as a transformers attention implementation (and its mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(name, _kvtier_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, eager_mask)
    return name


def install_recorder(model: torch.nn.Module, recorder: Optional[MassRecorder]) -> None:
    """Attach (or detach, with None) a recorder to every attention module of ``model``."""
    for m in model.modules():
        if hasattr(m, "num_key_value_groups"):
            m.kvtier_recorder = recorder  # type: ignore[assignment]  # torch stubs type Module.__setattr__ as Tensor | Module


__all__ = ["block_mass_attention", "block_mass", "repeat_kv", "MassRecorder", "register_attention",
           "install_recorder"]
