"""KV layout conversion between the engine's and kvtier's block layouts.

* block-major (kvtier's transfer unit): one block is contiguous and holds all
  layers, K and V: ``[num_layers, 2, block_tokens, kv_heads, head_dim]``.
* layer-major (vLLM's paged cache): one tensor per layer,
  ``[num_blocks, 2, block_tokens, kv_heads, head_dim]``.

``gather_blocks`` packs engine blocks into block-major rows (before a
demotion); ``scatter_blocks`` unpacks them back (after a promotion). These are
the torch reference implementations; they run on CPU and CUDA alike (a
Triton version can register in ``IMPLS`` without changing callers).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def block_major_shape(layer_caches: Sequence[torch.Tensor]) -> tuple[int, ...]:
    first = layer_caches[0]
    if first.dim() != 5 or first.shape[1] != 2:
        raise ValueError(f"layer cache must be [num_blocks, 2, tokens, heads, dim], got {tuple(first.shape)}")
    for lc in layer_caches:
        if lc.shape != first.shape or lc.dtype != first.dtype:
            raise ValueError("all layer caches must share shape and dtype")
    return (len(layer_caches), *first.shape[1:])


def gather_blocks(layer_caches: Sequence[torch.Tensor], block_ids: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Layer-major -> block-major: returns ``[n, L, 2, T, H, D]``."""
    shape = block_major_shape(layer_caches)
    idx = block_ids.to(device=layer_caches[0].device, dtype=torch.long)
    if out is None:
        out = torch.empty((idx.numel(), *shape), dtype=layer_caches[0].dtype, device=layer_caches[0].device)
    elif tuple(out.shape) != (idx.numel(), *shape):
        raise ValueError(f"out has shape {tuple(out.shape)}, need {(idx.numel(), *shape)}")
    for layer, lc in enumerate(layer_caches):
        out[:, layer].copy_(lc.index_select(0, idx))
    return out


def scatter_blocks(blocks: torch.Tensor, layer_caches: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
    """Block-major ``[n, L, 2, T, H, D]`` -> the engine's per-layer caches."""
    shape = block_major_shape(layer_caches)
    idx = block_ids.to(device=layer_caches[0].device, dtype=torch.long)
    if tuple(blocks.shape) != (idx.numel(), *shape):
        raise ValueError(f"blocks have shape {tuple(blocks.shape)}, need {(idx.numel(), *shape)}")
    for layer, lc in enumerate(layer_caches):
        lc.index_copy_(0, idx, blocks[:, layer].to(lc.device))


IMPLS: dict[str, tuple[Callable, Callable]] = {"torch": (gather_blocks, scatter_blocks)}
