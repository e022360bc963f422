"""Wire protocol: versioned msgpack messages, validated against per-op schemas.

Request  ``{"v": 1, "id": int, "op": str, "engine": str, "args": {...}}``
Reply    ``{"v": 1, "id": int, "ok": true, "result": {...}}`` or
         ``{"v": 1, "id": int, "ok": false, "error": {"code": str, "message": str}}``

Block ids and keys travel as packed little-endian ``int64``/``uint64`` bytes
(msgpack ``bin``) or as lists of ints; either decodes to one numpy array
without a per-element Python loop. Every decoding problem raises
``ProtocolError`` with a stable code; the server turns it into an error reply
and changes nothing.
"""

from __future__ import annotations

import threading
from typing import Any, Literal, Optional, Union

import msgpack
import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictBytes,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

VERSION = 1

# error codes (stable strings; clients map them to exceptions)
BAD_FRAME = "bad_frame"          # not msgpack / not a map / too large
BAD_VERSION = "bad_version"
BAD_REQUEST = "bad_request"      # schema violation
UNKNOWN_OP = "unknown_op"
UNKNOWN_ENGINE = "unknown_engine"
TOO_LARGE = "too_large"
NO_SPACE = "no_space"
TIMEOUT = "timeout"
CONFLICT = "conflict"            # e.g. a layout that disagrees with the daemon's
INVALID = "invalid"              # a well-formed request that misuses state (unknown block, double free)
INTERNAL = "internal"
CORRUPT = "corrupt"              # a block's only copy failed its checksum: it cannot be served
FORBIDDEN = "forbidden"          # an admin op without the daemon owner's token
IO_ERROR = "io_error"            # a block could not be read back after repeated I/O errors


class ProtocolError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


IdArray = Union[StrictBytes, list[StrictInt]]


class PingArgs(_Args):
    pass


class RegisterArgs(_Args):
    pid: StrictInt = Field(ge=0, le=(1 << 63) - 1)
    """Engine process id: the daemon reclaims its blocks when it dies."""
    namespace: StrictStr = Field(default="", max_length=255)
    """Key space of this engine (model, plus tenant or cache salt): blocks never cross namespaces."""
    pid_ns: StrictInt = Field(default=0, ge=0, le=(1 << 63) - 1)
    """Inode of the engine's pid namespace: the daemon judges ``pid`` only in its own (0: unknown)."""
    block_bytes: StrictInt = Field(gt=0, le=1 << 30)
    """Bytes of one block (all layers, K and V, ``block_tokens`` tokens)."""
    block_tokens: StrictInt = Field(default=16, gt=0, le=1 << 20)
    refs_only: StrictBool = False
    """The engine only looks keys up, refs and hints (a scheduler): it never allocates, seals
    or acquires, so it sees the blocks of every geometry of its namespace's name."""
    layout: dict[StrictStr, Union[StrictInt, StrictStr, StrictFloat, StrictBool]] = Field(default_factory=dict)
    """Free-form description (layers, heads, head_dim, dtype) kept for stats."""
    hbm_kind: Literal["daemon", "shm", "cuda_ipc"] = "daemon"
    """``daemon``: map the daemon's pool; ``shm``/``cuda_ipc``: adopt the engine's region."""
    hbm_name: Optional[StrictStr] = Field(default=None, max_length=255)
    hbm_handle: Optional[StrictBytes] = Field(default=None, max_length=4096)
    hbm_slots: StrictInt = Field(default=0, ge=0, le=1 << 26)


class AllocArgs(_Args):
    n: StrictInt = Field(ge=1)
    seq: Optional[StrictInt] = None
    pin: StrictBool = False
    """Return the blocks pinned (the engine releases them after writing)."""
    wait: StrictBool = False
    """No room yet: wait (up to ``timeout_s``) for demotions instead of answering no_space."""
    timeout_s: Optional[Union[StrictFloat, StrictInt]] = Field(default=None, ge=0, le=3600)


class SealArgs(_Args):
    blocks: IdArray
    keys: IdArray
    nbytes: Optional[StrictInt] = Field(default=None, ge=0)
    seq: Optional[StrictInt] = None
    fold_identical_only: StrictBool = False  # a key's block of other bytes: keep this one, unindexed


class RefArgs(_Args):
    keys: IdArray
    seq: Optional[StrictInt] = None


class LookupArgs(_Args):
    keys: IdArray
    """Keys to look up (no reference is taken: a connector asks what it could load)."""


class AcquireArgs(_Args):
    blocks: Optional[IdArray] = None
    keys: Optional[IdArray] = None
    seqs: Optional[list[StrictInt]] = None
    timeout_s: Optional[Union[StrictFloat, StrictInt]] = Field(default=None, ge=0, le=3600)
    wait: StrictBool = True
    """False: reply at once with a ticket; poll it with ``acquire_poll``."""


class AcquirePollArgs(_Args):
    ticket: StrictInt


class BlocksArgs(_Args):
    blocks: Optional[IdArray] = None
    seqs: Optional[list[StrictInt]] = None


class HintArgs(_Args):
    blocks: Optional[IdArray] = None
    keys: Optional[IdArray] = None
    seqs: Optional[list[StrictInt]] = None
    deadline_s: Union[StrictFloat, StrictInt] = Field(default=0.0, ge=0, le=3600)
    """Seconds until the engine expects to acquire these (earliest first)."""


class AdminArgs(_Args):
    token: Optional[StrictStr] = Field(default=None, max_length=128)
    """The daemon owner's capability (``admin.token`` in the runtime dir): clear, reload and check need it;
    stats without it leaves out other engines' details."""


ARGS: dict[str, type[_Args]] = {
    "ping": PingArgs, "heartbeat": PingArgs, "stats": AdminArgs, "unregister": PingArgs, "clear": AdminArgs,
    "check": AdminArgs,
    "register": RegisterArgs, "alloc": AllocArgs, "seal": SealArgs, "ref": RefArgs,
    "lookup": LookupArgs,
    "acquire": AcquireArgs, "acquire_poll": AcquirePollArgs, "release": BlocksArgs, "free": BlocksArgs,
    "hint": HintArgs, "reload": AdminArgs,
}
NO_ENGINE_OPS = frozenset({"ping", "stats", "reload", "register", "clear", "check"})
ADMIN_OPS = frozenset({"clear", "reload", "check"})  # the daemon owner's: they need ``token``


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    v: StrictInt
    id: StrictInt
    op: StrictStr = Field(max_length=64)
    engine: StrictStr = Field(default="", max_length=255)
    args: dict[StrictStr, Any] = Field(default_factory=dict)


_ENVELOPE = frozenset({"v", "id", "op", "engine", "args"})


_packers = threading.local()
PACKER_KEEP_BYTES = 1 << 20  # a packer whose buffer grew past this for one large frame is dropped


def pack(obj: Any) -> bytes:
    """msgpack bytes of ``obj`` from a per-thread ``Packer``: ``msgpack.packb`` builds a
    packer with a fresh 256 KiB buffer on every call, and with the daemon's malloc
    thresholds pinned (``daemon/allocator.py``) each of those is an mmap, page faults and
    an munmap on every request and reply (``bench rpc`` 1.94 -> 2.11)."""
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    out = packer.pack(obj)  # resets itself, also when obj cannot be packed
    if len(out) > PACKER_KEEP_BYTES:
        _packers.packer = None  # its buffer stays as large as the largest frame: let it go
    return out


def _unpack(frame: bytes, max_bytes: int) -> Any:
    if len(frame) > max_bytes:
        raise ProtocolError(TOO_LARGE, f"frame of {len(frame)} bytes exceeds {max_bytes}")
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(BAD_FRAME, f"undecodable frame: {type(e).__name__}") from None


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"]) or "(message)"
    return f"{loc}: {err['msg']}"


def decode_request(frame: bytes, max_bytes: int) -> tuple[Request, _Args]:
    obj = _unpack(frame, max_bytes)
    if not isinstance(obj, dict):
        raise ProtocolError(BAD_FRAME, "a request is a msgpack map")
    if obj.get("v") != VERSION:
        raise ProtocolError(BAD_VERSION, f"protocol version {obj.get('v')!r} unsupported; this daemon speaks {VERSION}")
    # the envelope is checked by hand (it is on every request's path); the schema is ``Request``
    rid, op, engine, args = obj.get("id"), obj.get("op"), obj.get("engine", ""), obj.get("args", {})
    if (len(obj) > 5 or type(rid) is not int or type(op) is not str or type(engine) is not str
            or type(args) is not dict or len(op) > 64 or len(engine) > 255 or not set(obj) <= _ENVELOPE):
        try:
            Request.model_validate(obj)  # for its precise message
        except ValidationError as e:
            raise ProtocolError(BAD_REQUEST, _first_error(e)) from None
        raise ProtocolError(BAD_REQUEST, "malformed request envelope")
    req = Request.model_construct(v=VERSION, id=rid, op=op, engine=engine, args=args)
    schema = ARGS.get(req.op)
    if schema is None:
        raise ProtocolError(UNKNOWN_OP, f"unknown op {req.op!r}; known: {sorted(ARGS)}")
    try:
        return req, schema.model_validate(req.args)
    except ValidationError as e:
        raise ProtocolError(BAD_REQUEST, f"{req.op}: {_first_error(e)}") from None


def request_id(frame: bytes) -> int:
    """Best-effort id of an undecodable request, so its error reply can be matched."""
    try:
        obj = msgpack.unpackb(frame, raw=False) if len(frame) < 1 << 20 else None
        rid = obj.get("id") if isinstance(obj, dict) else None
        return rid if isinstance(rid, int) else -1
    except Exception:
        return -1


_LE = {np.dtype(t): np.dtype(t).newbyteorder("<") for t in (np.int64, np.uint64, np.float32, np.int32)}


def ids(value: Any, dtype: "np.dtype | type", max_n: int, what: str) -> np.ndarray:
    """Decode a packed array (bytes, or a list of ints; of numbers for a float ``dtype``)."""
    dt = np.dtype(dtype)
    if value is None:
        return np.zeros(0, dtype=dt)
    if isinstance(value, (bytes, bytearray)):
        if len(value) % dt.itemsize:
            raise ProtocolError(BAD_REQUEST, f"{what}: {len(value)} bytes is not a multiple of {dt.itemsize}")
        arr = np.frombuffer(value, dtype=_LE.get(dt, dt))
        if arr.dtype != dt:
            arr = arr.astype(dt)
    else:
        try:  # a float array (attention mass) as floats: through uint64 [0.9, 0.1] became [0, 0]
            arr = np.asarray(value, dtype=np.float64 if dt.kind == "f" else np.int64 if dt.kind == "i" else np.uint64)
        except (OverflowError, TypeError, ValueError):
            raise ProtocolError(BAD_REQUEST, f"{what}: not a list of {'numbers' if dt.kind == 'f' else 'integers'}") from None
        arr = arr.astype(dt, copy=False)
    if arr.ndim != 1 or arr.size > max_n:
        raise ProtocolError(TOO_LARGE, f"{what}: {arr.size} entries exceed the limit of {max_n}")
    return arr


def id_bytes(arr: "np.ndarray | list[int]", dtype: "np.dtype | type" = np.int64) -> bytes:
    dt = np.dtype(dtype)
    return np.ascontiguousarray(arr, dtype=_LE.get(dt, dt)).tobytes()


def ok(rid: int, result: Optional[dict] = None, freed: int = 0) -> bytes:
    """A success reply; ``freed``: the daemon's count of block frees when it was made, which the
    client stamps its telemetry with (a report skips the ids freed after it)."""
    return pack({"v": VERSION, "id": rid, "ok": True, "result": result or {}, "freed": freed})


def error(rid: int, code: str, message: str) -> bytes:
    return pack({"v": VERSION, "id": rid, "ok": False, "error": {"code": code, "message": message}})


__all__ = ["VERSION", "ProtocolError", "ARGS", "NO_ENGINE_OPS", "ADMIN_OPS", "decode_request", "request_id", "ids", "id_bytes",
           "ok", "error", "pack"]
