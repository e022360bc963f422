"""The remote tier's store: sealed blocks in a Redis Cluster, self-describing and verified.

A block is stored as Redis strings named ``kvt2:{<namespace tag>:<key>}:<part>``
(16 hex digits each; the braces are a hash tag, so every part of a block lives
in one slot, on one shard): part ``h`` is a 56-byte header (magic, version,
namespace tag, key, length, checksum, chunk count, the write's nonce, and a check
of the header's own bytes), parts ``0..n-1`` the payload
in chunks of at most ``chunk_bytes``, each its own ``SET`` sent straight from
the slot's memory (no copy), so a large block never becomes one huge command
that stalls a shard. The header is written last: one shard runs a block's
commands in order, so a reader that finds the header finds the payload. A read
is one ``GET`` per part; the bytes are checked against the header (namespace, key,
length) and the block checksum (``kernels/checksum.py``, the same value the
block table holds) before they count: a value that fails is deleted, counted,
and reported as a miss, never served. A block missing a chunk (the shard's
eviction took part of it) is a miss, and its other chunks are deleted. A value
of another format version, or chunked finer than this reader fetches, is a miss
left in place (``_verify``: "foreign"; format 1 used other names, so it is not
even read); the header's own check tells a flipped
bit in its version or chunk count (corrupt: deleted) from another writer's
format. A delete is conditional (one Lua script, atomic on the block's shard):
only while the header is still the one the reader refused, so a complete copy
another node published meanwhile (its nonce differs; once its header, written
last, has landed) is not deleted for the torn or corrupt one it replaced. Values are written and read through
redis-py's cluster pipelines.

Only sealed blocks are stored: they are immutable and content-addressed, so a
copy written by any node is as good as any other's, and two writers of one key
write the same bytes (a racing overwrite is harmless).
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import xxhash

from kvtier.kernels.checksum import block_checksum

from .types import TierError, geometry_ident

log = logging.getLogger("kvtier.remote")

try:  # optional: the store refuses to start without redis (``RedisClusterStore``)
    from redis.exceptions import ResponseError as _ResponseError
except ImportError:  # pragma: no cover - exercised where the remote extra is not installed
    _ResponseError = None  # type: ignore[assignment,misc]

MAGIC = b"KVR1"
VERSION = 2  # 2: the header's own check and a per-write nonce (56 bytes); 1: 48 bytes, neither
# magic, version, ns tag, key, length, checksum, chunks, nonce, check (xxh32 of the bytes before it)
HEADER = struct.Struct("<4sIQQQQIQI")
_CHECKED = HEADER.size - 4
PREFIX = "kvt2"  # format 2's names: a format-1 reader (which deleted any header of another size
# as corrupt) never sees them, so a rolling upgrade wipes nothing; format-1 values age out
# delete a value's parts only while its header is still the one the reader refused: ARGV[1] is
# "s" + those bytes, or "n" when the header held no string at all. Atomic on the block's shard,
# so a copy published between the read and the delete stays; keys deleted one at a time (a
# block of thousands of chunks would pass Lua's unpack limit)
_DELETE_IF_UNCHANGED = """
local t = redis.call('TYPE', KEYS[1])['ok']
if string.sub(ARGV[1], 1, 1) == 'n' then
  if t == 'string' then return -1 end
elseif t ~= 'string' or 's' .. redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return -1
end
for i = 1, #KEYS do redis.call('DEL', KEYS[i]) end
return #KEYS
"""


class RemoteError(TierError):
    """The remote store failed (unreachable, timeout, refused)."""


class RemoteAuthError(RemoteError):
    """The cluster refused our credentials (wrong ACL user or password)."""


def namespace_tag(fleet: str, engine_ns: str,
                  geometry: "Optional[tuple[int, int] | tuple[int, int, str]]" = None) -> int:
    """64-bit tag of (the fleet's remote namespace, the engines' namespace, their blocks'
    geometry: bytes, tokens and the KV dtype an engine stated): keys of two models, tenants, deployments or block sizes
    never meet. Without the geometry, a node whose engines write 2 KiB blocks and one whose
    engines of the same namespace write 4 KiB blocks (another KV dtype) read each other's
    values: the larger served the smaller's bytes and the rest of its slot as a hit."""
    ident = fleet.encode() + b"\0" + engine_ns.encode()
    if geometry is not None:
        ident += b"\0" + geometry_ident(geometry)
    return xxhash.xxh3_64_intdigest(ident)


def value_name(tag: int, key: int, part: "int | str" = "h") -> str:
    """Redis key of a block's header (``"h"``) or of its payload chunk ``part``."""
    return f"{PREFIX}:{{{tag:016x}:{key:016x}}}:{part}"


def pack_header(tag: int, key: int, length: int, checksum: int, chunks: int, nonce: int = 0) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, tag, key, length, checksum, chunks, nonce & (2**64 - 1), 0)
    return head[:_CHECKED] + xxhash.xxh32_intdigest(head[:_CHECKED]).to_bytes(4, "little")


def header_fields(head: bytes) -> "tuple[int, int, int, int, int] | str":
    """(tag, key, length, checksum, chunks) of a header this reader takes, else "corrupt"
    (not a header, or one whose own check fails: a flipped bit) or "foreign" (a well-formed
    header of another format version: another node's, left in place)."""
    if len(head) < 8 or head[:4] != MAGIC:
        return "corrupt"
    version = int.from_bytes(head[4:8], "little")
    if len(head) != HEADER.size:  # another version's layout (version 1: 48 bytes), or garbage
        return "foreign" if version != VERSION else "corrupt"
    _, _, tag, key, length, checksum, chunks, _, check = HEADER.unpack(head)
    if check != xxhash.xxh32_intdigest(head[:_CHECKED]):
        return "corrupt"
    if version != VERSION:
        return "foreign"
    return tag, key, length, checksum, chunks


@dataclass
class GetResult:
    found: np.ndarray  # bool per block: verified bytes are in the destination
    lengths: np.ndarray  # int64: payload length of found blocks
    checksums: np.ndarray  # uint64: their checksum
    corrupt: int  # values that failed verification (deleted)
    nbytes: int  # payload bytes read


def _is_reply(e: BaseException) -> bool:
    """An error the server replied with (OOM, READONLY, WRONGTYPE), not a transport failure
    (redis-py 8 puts a timed-out or dropped command's exception in the pipeline's results)."""
    return _ResponseError is not None and isinstance(e, _ResponseError)


def _wrong_type(e: BaseException) -> bool:
    """A reply that the key holds another type (not a string): a value, not the transport, is wrong."""
    return _is_reply(e) and str(e).startswith("WRONGTYPE")


def _is_auth_error(e: BaseException) -> bool:
    text = str(e).lower()
    return any(w in text for w in ("wrongpass", "invalid username-password", "noauth", "authentication",
                                   "authenticated", "noperm", "user is disabled"))


class RedisClusterStore:
    """A connection to one Redis Cluster; used from one worker thread at a time."""

    def __init__(self, nodes: Sequence[str], username: Optional[str] = None,
                 password: Optional[str] = None, tls: bool = False, tls_ca_file: Optional[str] = None,
                 tls_cert_file: Optional[str] = None, tls_key_file: Optional[str] = None,
                 tls_verify: bool = True, connect_timeout_s: float = 2.0, timeout_s: float = 2.0,
                 chunk_bytes: int = 4 << 20) -> None:
        try:
            from redis.cluster import ClusterNode, RedisCluster
        except ImportError:
            raise RemoteError("the remote tier needs the redis package: pip install 'kvtier[remote]'") from None
        if not nodes:
            raise ValueError("the remote tier needs at least one startup node")
        if chunk_bytes < 4096:
            raise ValueError("chunk_bytes must be >= 4096")
        self.chunk_bytes = int(chunk_bytes)
        self.refused = ""  # the last put_many's per-command errors, summarised ("" when none)
        # each write's header differs (a republished value is told from the one a reader refused)
        self._nonces = itertools.count(int.from_bytes(os.urandom(8), "little"))
        startup = []
        for n in nodes:
            host, _, port = n.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"remote node {n!r} is not host:port")
            startup.append(ClusterNode(host, int(port)))
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # no retry inside a batch: a batch that fails completes as failed and the tier's backoff is
        # the retry (redirects after a failover are followed apart from this). redis-py's default,
        # ten retries with growing pauses, held a batch 23 s against a hung shard at timeout_s = 1
        # (3 s now), while the blocks it read or wrote stayed held and the tier still said "ok"
        kw: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": connect_timeout_s,
                              "retry": Retry(NoBackoff(), 0)}
        if username:
            kw["username"] = username
        if password:
            kw["password"] = password
        if tls:
            kw.update(ssl=True, ssl_ca_certs=tls_ca_file, ssl_certfile=tls_cert_file, ssl_keyfile=tls_key_file,
                      ssl_cert_reqs="required" if tls_verify else "none")
        where = ", ".join(nodes)
        try:
            self.client = RedisCluster(startup_nodes=startup, require_full_coverage=False, **kw)
            self._delete_if_unchanged = self.client.register_script(_DELETE_IF_UNCHANGED)
            self._scripting = True  # False once the cluster refuses the script (see ``_delete``)
            self.client.ping(target_nodes=RedisCluster.PRIMARIES)
        except Exception as e:  # redis raises many kinds; each is a clear start-up error here
            if _is_auth_error(e):
                who = f"user {username!r}" if username else "the default user"
                why = "wrong user or password" if password else "it needs a password and none was given"
                raise RemoteAuthError(f"remote tier: the Redis Cluster at {where} refused {who}: {why} "
                                      f"(tiers.remote.username, tiers.remote.password or $KVTIER_REMOTE_PASSWORD)") from None
            raise RemoteError(f"remote tier: cannot reach the Redis Cluster at {where}: {e}") from None

    # -- writes -----------------------------------------------------------------------------
    def put_many(self, tags: np.ndarray, keys: np.ndarray, payloads: Sequence[Any], lengths: np.ndarray,
                 checksums: np.ndarray) -> np.ndarray:
        """Store blocks (payloads: buffers of at least ``lengths[i]`` bytes); per block: stored."""
        pipe = self.client.pipeline()
        spans = []
        cb = self.chunk_bytes
        for tag, key, buf, n, cs in zip(tags.tolist(), keys.tolist(), payloads, lengths.tolist(), checksums.tolist()):
            view = memoryview(buf).cast("B")[:n]
            chunks = max(1, -(-n // cb))
            first = len(pipe)
            for i in range(chunks):  # zero-copy: redis-py sends each chunk straight from the slot
                pipe.set(value_name(tag, key, i), view[i * cb: (i + 1) * cb])
            pipe.set(value_name(tag, key), pack_header(tag, key, n, cs, chunks, next(self._nonces)))  # last: a reader that
            # finds the header finds the payload (one shard runs a block's commands in order)
            spans.append((first, len(pipe)))
        results = self._execute(pipe)
        errors = [r for r in results if isinstance(r, Exception)]
        lost = next((r for r in errors if not _is_reply(r)), None)
        if lost is not None:  # a timeout or a dropped connection a command at a time: the transport failed
            raise RemoteError(f"remote tier: {type(lost).__name__}: {lost}")
        # the cluster's own refusal (OOM under noeviction, READONLY): the caller must back off, not
        # offer the block again at once
        self.refused = f"{len(errors)} of {len(results)} writes refused, first: {errors[0]}" if errors else ""
        return np.array([not any(isinstance(r, Exception) for r in results[a:b]) for a, b in spans], dtype=bool)

    def _execute(self, pipe: Any) -> list:
        try:
            return pipe.execute(raise_on_error=False)
        except Exception as e:
            if _is_auth_error(e):
                raise RemoteAuthError(f"remote tier: authentication failed: {e}") from None
            raise RemoteError(f"remote tier: {type(e).__name__}: {e}") from None

    # -- reads ------------------------------------------------------------------------------
    def get_many(self, tags: np.ndarray, keys: np.ndarray, dsts: Sequence[np.ndarray]) -> GetResult:
        """Read blocks into ``dsts`` (uint8 arrays, one block slot each), verified."""
        pipe = self.client.pipeline()
        spans = []
        for tag, key, dst in zip(tags.tolist(), keys.tolist(), dsts):
            first = len(pipe)
            pipe.get(value_name(tag, key))
            for i in range(max(1, -(-dst.size // self.chunk_bytes))):
                pipe.get(value_name(tag, key, i))
            spans.append((first, len(pipe)))
        results = self._execute(pipe)
        n = len(dsts)
        found = np.zeros(n, dtype=bool)
        lengths = np.zeros(n, dtype=np.int64)
        sums = np.zeros(n, dtype=np.uint64)
        bad: list[tuple[list[str], bytes]] = []  # (a value's names, the header refused)
        corrupt = nbytes = 0
        for i, (tag, key, (a, b), dst) in enumerate(zip(tags.tolist(), keys.tolist(), spans, dsts)):
            parts = results[a:b]
            got: "tuple[int, int] | str"
            if any(isinstance(r, Exception) for r in parts):
                if not all(_wrong_type(r) for r in parts if isinstance(r, Exception)):
                    raise RemoteError(f"remote tier: {next(r for r in parts if isinstance(r, Exception))}")
                got = "corrupt"  # a key of ours holding no string: not our value, and it must go
            elif parts[0] is None:
                continue  # not stored (or evicted): a miss
            else:
                got = self._verify(tag, key, parts, dst)
            if got == "foreign":  # another format's value: a miss here, left for the nodes that read it
                continue
            if isinstance(got, str):  # refused: never served, deleted so nobody reads it again
                names = [value_name(tag, key), *(value_name(tag, key, j) for j in range(len(parts) - 1))]
                bad.append((names, b"s" + parts[0] if isinstance(parts[0], bytes) else b"n"))
                corrupt += got == "corrupt"
                continue
            found[i], lengths[i], sums[i] = True, got[0], got[1]
            nbytes += got[0]
        if bad:
            self._delete(bad)
        return GetResult(found, lengths, sums, corrupt, nbytes)

    def _verify(self, tag: int, key: int, parts: list, dst: np.ndarray) -> "tuple[int, int] | str":
        """(length, checksum) once the bytes in ``dst`` match the header; else "corrupt",
        "partial" for a block the shard's eviction took part of, or "foreign" for a value this
        reader cannot take but another node may: another format version, or chunks smaller
        than this reader fetched (another ``chunk_bytes``). A foreign value is a miss, not
        deleted: a rolling upgrade or a config drift must not wipe the cluster."""
        head, body = parts[0], parts[1:]
        fields = header_fields(head)
        if isinstance(fields, str):
            return fields
        h_tag, h_key, length, cs, chunks = fields
        if (h_tag, h_key) != (tag, key) or length > dst.size or chunks < 1:
            return "corrupt"
        if chunks > len(body):
            return "foreign"
        if any(p is None for p in body[:chunks]):
            return "partial"
        pos = 0
        for part in body[:chunks]:
            data = memoryview(part)
            if pos + len(data) > length:
                return "corrupt"
            dst[pos: pos + len(data)] = np.frombuffer(data, dtype=np.uint8)
            pos += len(data)
        if pos != length or block_checksum(dst, length) != cs:
            return "corrupt"
        return length, cs

    def _delete(self, values: list[tuple[list[str], bytes]]) -> None:
        """Delete each refused value's parts if its header is still the one read (a round trip
        each: scripts do not pipeline in a cluster, and refused values are rare). Best effort:
        the batch's verified reads stand whatever happens here. A cluster that refuses scripts
        (an ACL user without EVALSHA) gets plain deletes, which may take a copy republished
        meanwhile (one miss) but never leave a corrupt value to be refused on every read."""
        for names, head in values:
            try:
                if self._scripting:
                    self._delete_if_unchanged(keys=names, args=[head])
                    continue
            except Exception as e:
                if not _is_reply(e):
                    log.warning("remote tier: deleting a refused value failed: %s", e)
                    return  # the transport: later reads find it and try again
                self._scripting = False
                log.warning("remote tier: the cluster refused the conditional delete (%s); deleting "
                            "refused values unconditionally from now on", e)
            try:
                self._delete_plain(names)
            except Exception as e:
                log.warning("remote tier: deleting a refused value failed: %s", e)
                return

    def _delete_plain(self, names: list[str]) -> None:
        pipe = self.client.pipeline()
        for name in names:
            pipe.delete(name)
        pipe.execute(raise_on_error=False)

    # -- admin ------------------------------------------------------------------------------
    def primaries(self) -> int:
        return len(self.client.get_primaries())

    def bound_memory(self, capacity_bytes: int) -> str:
        """Give each primary ``capacity_bytes / primaries`` as maxmemory, evicting allkeys-lru;
        "" when done, else why not (an ACL user without CONFIG: the operator sets it)."""
        primaries = self.client.get_primaries()
        each = max(1, capacity_bytes // max(1, len(primaries)))
        try:
            for node in primaries:
                self.client.config_set("maxmemory", str(each), target_nodes=node)
                self.client.config_set("maxmemory-policy", "allkeys-lru", target_nodes=node)
        except Exception as e:
            return f"cannot bound the cluster's memory ({e}); set maxmemory and maxmemory-policy allkeys-lru on it"
        return ""

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass


__all__ = ["RedisClusterStore", "RemoteError", "RemoteAuthError", "GetResult", "namespace_tag", "value_name",
           "pack_header", "header_fields", "HEADER"]
