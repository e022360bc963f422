"""Key summaries per sealed block and the Quest upper bound of q.k.

For a block with per-channel key minima m and maxima M, any key k in it
satisfies m <= k <= M channel-wise, so for a query q
    q.k = sum_c q_c k_c <= sum_c max(q_c m_c, q_c M_c).
This bound (Quest, Tang et al. 2024) lets a later certified sparse-fetch mode
skip blocks whose bound proves their attention weight negligible. In exact
mode it is only used to order prefetch.
"""

from __future__ import annotations

import torch


def key_summary(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (min, max) over the token axis of ``keys[..., tokens, dim]``."""
    if keys.dim() < 2 or keys.shape[-2] == 0:
        raise ValueError("keys need a non-empty token axis (shape [..., tokens, dim])")
    return keys.amin(dim=-2), keys.amax(dim=-2)


def quest_upper_bound(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Upper bound of q.k over every key a summary covers.

    ``query[..., dim]`` broadcasts against ``kmin/kmax[..., dim]``; the result
    drops the last axis. Computed in float64 so the bound holds exactly for
    float16/bfloat16/float32 inputs.
    """
    q = query.double()
    return torch.maximum(q * kmin.double(), q * kmax.double()).sum(dim=-1)


__all__ = ["key_summary", "quest_upper_bound"]
