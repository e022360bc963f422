"""Where each layer's blocks are in vLLM's paged KV tensors, and the kvtier block built from
them: layer l's K/V bytes exactly as vLLM laid them out, then a ``DIGEST_BYTES`` trailer with
the block's full vLLM hash, so layer parts are equal and the daemon promotes them layer by
layer. Shared by the sync (``vllm_worker``) and async (``vllm_async``) loads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .keys import DIGEST_BYTES


@dataclass
class _Layer:
    name: str
    tensor: torch.Tensor
    bdim: int         # the dimension of vLLM's tensor that indexes blocks
    nbytes: int       # bytes of one block of this layer


class Geometry:
    """Where each layer's blocks are in vLLM's tensors, and the kvtier block built from them."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        self.layers: list[_Layer] = []
        aliases: dict[str, str] = {}  # a layer sharing another's KV (cross-layer sharing) -> that layer
        seen: dict[tuple, str] = {}
        for name, t in kv_caches.items():
            same = seen.setdefault((t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype), name)
            if same != name:  # vLLM hands the sharing layer the target's tensor: its bytes once
                aliases[name] = same
                continue
            dims = [d for d, s in enumerate(t.shape) if s == num_blocks]
            if not dims:
                raise ValueError(f"layer {name}: no dimension of {tuple(t.shape)} has {num_blocks} blocks")
            one = t.select(dims[0], 0)
            self.layers.append(_Layer(name, t, dims[0], one.numel() * t.element_size()))
        if len({(x.nbytes, x.tensor.dtype) for x in self.layers}) != 1:
            raise ValueError("kvtier needs every layer's block to have one size and dtype")
        self.index = {x.name: i for i, x in enumerate(self.layers)}
        self.index |= {a: self.index[target] for a, target in aliases.items()}  # waits on its target
        self.part = self.layers[0].nbytes + DIGEST_BYTES  # one layer of one kvtier block
        self.block_bytes = self.part * len(self.layers)

    def view_part(self, layer: int, row: torch.Tensor) -> torch.Tensor:
        """Layer ``layer`` of one kvtier block (``row``: its staging slot's bytes), as vLLM's block shape."""
        x = self.layers[layer]
        off = layer * self.part
        return row[off:off + x.nbytes].view(x.tensor.dtype).view(x.tensor.select(x.bdim, 0).shape)

    def save(self, layer: int, vid: int, row: torch.Tensor) -> None:
        """One strided copy, vLLM's block -> the staging slot (no intermediate tensor)."""
        x = self.layers[layer]
        self.view_part(layer, row).copy_(x.tensor.select(x.bdim, vid))

    def load(self, layer: int, vid: int, row: torch.Tensor) -> None:
        x = self.layers[layer]
        x.tensor.select(x.bdim, vid).copy_(self.view_part(layer, row))

    def settle(self) -> None:
        """Wait for this process's copies between vLLM's KV and the staging slots. On a GPU
        they are queued on the current stream; a seal or a release hands the slot to the
        daemon, which may then demote or reuse it before the queued copy ran."""
        t = self.layers[0].tensor
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()

    def trailer(self, layer: int, row: torch.Tensor) -> torch.Tensor:
        off = layer * self.part + self.layers[layer].nbytes
        return row[off:off + DIGEST_BYTES]
