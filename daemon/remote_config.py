"""``[tiers.remote]``: the shared remote tier on a Redis Cluster (off by default).

The password is a secret: it is read from the config, or from the environment
variable ``password_env`` names, and it is never printed (``config show``,
``stats``, logs and error messages leave it out).
"""

from __future__ import annotations

import os
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator


class RemoteConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True,
                              allow_inf_nan=False)

    enabled: bool = False
    """Use a shared remote tier below NVMe (needs the redis package: pip install 'kvtier[remote]')."""
    nodes: list[str] = Field(default_factory=lambda: ["127.0.0.1:7000"])
    """Startup nodes of the Redis Cluster, host:port (any reachable one finds the rest)."""

    @field_validator("nodes")
    @classmethod
    def _host_ports(cls, v: list[str]) -> list[str]:
        # caught by `config validate`, not first at `serve` when the tier connects
        if not v:
            raise ValueError("the remote tier needs at least one startup node (host:port)")
        for n in v:
            host, _, port = n.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"remote node {n!r} is not host:port")
        return v
    namespace: str = "kvtier"
    """The fleet's key space in the cluster: nodes that share blocks use the same value. Keys are scoped
    by this and by each engine's namespace (model, tenant, salt), so two models never meet."""
    username: Optional[str] = None
    """Redis ACL user (None: the default user)."""
    password: Optional[SecretStr] = Field(default=None, exclude=True, repr=False)
    """Redis password (never printed; prefer the environment variable named by password_env)."""
    password_env: str = "KVTIER_REMOTE_PASSWORD"
    """Environment variable read for the password when password is not set."""
    tls: bool = False
    """Connect over TLS."""
    tls_ca_file: Optional[str] = None
    """CA bundle that signed the cluster's certificates (None: the system's)."""
    tls_cert_file: Optional[str] = None
    """Client certificate (mutual TLS)."""
    tls_key_file: Optional[str] = None
    """Client certificate's key."""
    tls_verify: bool = True
    """Verify the cluster's certificates."""
    connect_timeout_s: float = Field(default=2.0, gt=0)
    """Connecting to a shard gives up after this long."""
    timeout_s: float = Field(default=1.0, gt=0)
    """A shard's reply is waited for this long; a batch against a hung shard fails within a few of
    these (no retries inside a batch: the tier's backoff retries), the tier degrades, engines recompute."""
    lookup_timeout_s: float = Field(default=0.5, gt=0)
    """A ref that missed locally waits at most this long for the remote lookup; then the keys are misses."""
    capacity_bytes: int = Field(default=0, ge=0)
    """Memory the cluster may give kvtier, split evenly over the primaries as their maxmemory (with
    maxmemory-policy allkeys-lru) at start; 0 leaves the cluster's own settings."""
    chunk_bytes: int = Field(default=4 << 20, ge=4096)
    """Largest piece of a block in one command (a large block never stalls a shard as one huge write)."""
    batch_blocks: int = Field(default=32, ge=1, le=4096)
    """Blocks per pipelined batch."""
    workers: int = Field(default=2, ge=1, le=64)
    """Worker threads (each with its own cluster connection): batches in flight at once."""
    queue_depth: int = Field(default=16, ge=1, le=4096)
    """Batches queued for the workers; when full, a publish waits and a lookup misses (nothing blocks)."""
    bandwidth_bytes_per_s: float = Field(default=1e9, gt=0)
    """Network budget of publishing (lookups an engine waits for are not throttled)."""
    publish_min_shares: int = Field(default=1, ge=0)
    """Publish a sealed block once this many other sequences reused it on this node (a seal that folded
    into it, or a ref of its key); 0 publishes every sealed block the value model admits."""
    backoff_s: float = Field(default=1.0, gt=0)
    """After a failed batch the tier is skipped this long, doubling while batches keep failing ..."""
    backoff_max_s: float = Field(default=30.0, gt=0)
    """... up to this long; the first batch that succeeds clears it."""

    def secret(self) -> Optional[str]:
        """The password: from the config, else from ``password_env`` (None: no password)."""
        if self.password is not None:
            return self.password.get_secret_value()
        return os.environ.get(self.password_env) or None


__all__ = ["RemoteConfig"]
