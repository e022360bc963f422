"""The first step's gather from the paged slots: every row's K/V in token order, exact."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtier.client.hf_cache import KVLayout, TieredCache


def _reference(pool: torch.Tensor, slots: list[int], layer: int, n_tok: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: token t of a row is in block t // T at offset t % T."""
    T = pool.shape[4]
    k = torch.stack([pool[slots[t // T], layer, 0, :, t % T] for t in range(n_tok)], dim=1)
    v = torch.stack([pool[slots[t // T], layer, 1, :, t % T] for t in range(n_tok)], dim=1)
    return k, v


@pytest.mark.parametrize("length,q_len", [(0, 32), (16, 16), (5, 30), (47, 1), (0, 3)])
def test_gather_is_every_rows_tokens_in_order_and_contiguous(length, q_len):
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_tokens=8, dtype=torch.float32)
    pool = torch.randn(12, *layout.shape, generator=torch.Generator().manual_seed(length + q_len))
    rows = [SimpleNamespace(length=length, slots=[7, 2, 11, 0, 5, 9, 3]),
            SimpleNamespace(length=length, slots=[1, 4, 6, 8, 10, 2, 0])]
    cache = SimpleNamespace(layout=layout, rows=rows, pool=pool)
    for layer in range(layout.num_layers):
        k, v = TieredCache._gather(cache, layer, q_len)  # type: ignore[arg-type]  # only these fields are read
        assert k.shape == v.shape == (2, 2, length + q_len, 4)
        assert k.is_contiguous() and v.is_contiguous()
        for i, row in enumerate(rows):
            rk, rv = _reference(pool, row.slots, layer, length + q_len)
            assert torch.equal(k[i], rk) and torch.equal(v[i], rv)


def test_gather_refuses_rows_of_different_lengths():
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_tokens=4, dtype=torch.float32)
    cache = SimpleNamespace(layout=layout, pool=torch.zeros(4, *layout.shape),
                            rows=[SimpleNamespace(length=3, slots=[0, 1]), SimpleNamespace(length=4, slots=[2, 3])])
    with pytest.raises(RuntimeError, match="different lengths"):
        TieredCache._gather(cache, 0, 1)  # type: ignore[arg-type]
