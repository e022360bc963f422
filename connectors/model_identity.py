"""Which weights made a KV cache: a fingerprint for the vLLM connector's namespace.

vLLM's block hashes cover token ids, LoRA, multimodal inputs and cache salts, but
not the weights. The namespace had been the model's path string and dtypes, so a
second model served from the same path (one container mount point, ``./model``,
another revision) found the first model's blocks, passed the trailer check (same
vLLM hash) and decoded from another model's KV. The fingerprint hashes what
decides the KV bytes: the effective model config (``hf_config`` after any
``hf_overrides``: rope scaling, layer counts), the revision and quantization, and
for a local directory each weight file's name, size and sampled content (a few
64 KiB windows a file, and in a safetensors file the start, middle and end of every
tensor, from its header: a fine-tune of a few layers, or a LoRA merged into some
projections, changes whole tensors that the file's windows may all miss; a 7B
checkpoint reads a few MB). Copies of one checkpoint
on two nodes fingerprint alike, so they share the remote tier. A hub id without a
local directory is identified by name and revision only (pin the revision).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import xxhash

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz", ".msgpack", ".h5")
WINDOW = 64 << 10  # bytes hashed at each sampled offset
WINDOWS = 8  # offsets a file, evenly spaced, the first at 0 and the last at the end
TENSOR_WINDOW = 4 << 10  # bytes hashed at a safetensors tensor's start, middle and end
MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one (the format's own limit)
VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path", "_commit_hash")  # not the weights' identity


def _weight_files(directory: str) -> list[str]:
    out = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        out += [os.path.join(root, f) for f in files if f.endswith(WEIGHT_SUFFIXES)]
    return sorted(out)


def _tensor_spans(f: Any, size: int) -> list[tuple[int, int]]:
    """A safetensors file's tensors as (start, end) file offsets, in file order; [] where the
    file is not one (its 8-byte header length, then a JSON header of ``data_offsets``)."""
    f.seek(0)
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else 0
    if not 2 <= n <= min(MAX_HEADER, size - 8):
        return []
    try:
        header = json.loads(f.read(n))
        spans = [tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, AttributeError):
        return []
    base = 8 + n
    return sorted((base + int(a), base + int(b)) for a, b in spans if 0 <= int(a) <= int(b) <= size - base)


def file_digest(path: str) -> bytes:
    """Size and ``WINDOWS`` sampled windows of a weight file, and in a safetensors file each
    tensor's first, middle and last ``TENSOR_WINDOW`` bytes."""
    h = xxhash.xxh3_128()
    size = os.path.getsize(path)
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        last = max(0, size - WINDOW)
        for i in range(WINDOWS):
            f.seek(last * i // max(1, WINDOWS - 1))
            h.update(f.read(WINDOW))
        if path.endswith(".safetensors"):
            for a, b in _tensor_spans(f, size):
                for at in sorted({a, max(a, (a + b - TENSOR_WINDOW) // 2), max(a, b - TENSOR_WINDOW)}):
                    f.seek(at)
                    h.update(f.read(min(TENSOR_WINDOW, b - at)))
    return h.digest()


def _config_bytes(config: Optional[dict]) -> bytes:
    if not config:
        return b""
    kept = {k: v for k, v in config.items() if k not in VOLATILE_CONFIG_KEYS}
    return json.dumps(kept, sort_keys=True, default=str).encode()


def model_fingerprint(model: str, config: Optional[dict] = None, revision: Optional[str] = None,
                      quantization: Optional[str] = None) -> str:
    """16 hex digits naming the model's weights and KV-relevant config (see module doc)."""
    h = xxhash.xxh3_128()
    h.update(_config_bytes(config))
    h.update(f"\0rev={revision or ''}\0quant={quantization or ''}\0".encode())
    if os.path.isdir(model):
        for path in _weight_files(model):
            h.update(os.path.relpath(path, model).encode() + b"\0" + file_digest(path))
    else:
        h.update(b"hub:" + model.encode())
    return h.hexdigest()[:16]


def vllm_fingerprint(model_config: Any) -> str:
    """``model_fingerprint`` of a vLLM ``ModelConfig``."""
    hf = getattr(model_config, "hf_config", None)
    config = hf.to_dict() if hf is not None and hasattr(hf, "to_dict") else None
    return model_fingerprint(str(model_config.model), config, getattr(model_config, "revision", None),
                             getattr(model_config, "quantization", None))


__all__ = ["model_fingerprint", "vllm_fingerprint", "file_digest"]
