"""CUDA IPC handles for an engine's HBM region, without pickle.

The engine exports its KV tensor's storage with torch's ``_share_cuda_``;
the fields travel as a msgpack list and the daemon rebuilds the storage with
``UntypedStorage._new_shared_cuda``, mapping the same device memory. Only
bytes, ints and bools cross the socket: nothing is executed on decode.
"""

from __future__ import annotations

import msgpack
import torch


def export_handle(tensor: torch.Tensor) -> bytes:
    if tensor.device.type != "cuda" or not tensor.is_contiguous():
        raise ValueError("a CUDA IPC export needs a contiguous CUDA tensor")
    fields = tensor.untyped_storage()._share_cuda_()
    return msgpack.packb([tensor.device.index or 0, tensor.storage_offset() * tensor.element_size(),
                          tensor.numel() * tensor.element_size(), list(fields)], use_bin_type=True)


def region_identity(blob: bytes) -> tuple:
    """What names the exported bytes (device, offset, length, and the allocation's IPC handle,
    size and offset), without the per-export reference counter and event, which differ on
    every export of the same tensor; no CUDA needed. ValueError if malformed."""
    try:
        device, offset, nbytes, fields = msgpack.unpackb(blob, raw=False)
    except Exception as e:
        raise ValueError(f"malformed CUDA IPC handle: {e}") from None
    if not isinstance(fields, list) or len(fields) != 8:
        raise ValueError("malformed CUDA IPC handle")
    return (device, offset, nbytes, *fields[:4])


def import_handle(blob: bytes) -> torch.Tensor:
    """A uint8 view of the exporter's bytes (valid while the exporter lives)."""
    device, offset, nbytes, fields = msgpack.unpackb(blob, raw=False)
    if not (isinstance(device, int) and isinstance(offset, int) and isinstance(nbytes, int)
            and isinstance(fields, list) and len(fields) == 8):
        raise ValueError("malformed CUDA IPC handle")
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(*fields)
    flat = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
    flat.set_(storage, 0, (storage.nbytes(),))  # type: ignore[call-overload]  # torch stubs lack the optional stride
    return flat[offset: offset + nbytes]


__all__ = ["export_handle", "import_handle", "region_identity"]
