import pytest
import torch

from kvtier.kernels.layout import gather_blocks, scatter_blocks


def test_gather_scatter_roundtrip_exact():
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(6, 2, 4, 3, 8, generator=g, dtype=torch.float32).to(torch.bfloat16) for _ in range(5)]
    ids = torch.tensor([4, 0, 2])
    packed = gather_blocks(layers, ids)
    assert packed.shape == (3, 5, 2, 4, 3, 8)
    for j, b in enumerate(ids.tolist()):
        for layer in range(5):
            assert torch.equal(packed[j, layer], layers[layer][b])
    target = [torch.zeros_like(x) for x in layers]
    scatter_blocks(packed, target, torch.tensor([1, 3, 5]))
    for layer in range(5):
        assert torch.equal(target[layer][1], layers[layer][4])
        assert torch.equal(target[layer][5], layers[layer][2])
        assert torch.count_nonzero(target[layer][0]) == 0
    # the packed rows are plain bytes: a byte-level round trip is exact
    raw = packed.contiguous().view(torch.uint8).clone()
    assert torch.equal(raw.view(torch.bfloat16).view_as(packed), packed)


def test_shape_errors():
    layers = [torch.zeros(2, 2, 4, 1, 8) for _ in range(2)]
    with pytest.raises(ValueError):
        scatter_blocks(torch.zeros(1, 3, 2, 4, 1, 8), layers, torch.tensor([0]))
    with pytest.raises(ValueError):
        gather_blocks([torch.zeros(2, 3, 4)], torch.tensor([0]))
