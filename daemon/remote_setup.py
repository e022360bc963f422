"""Building the remote tier from ``[tiers.remote]``: at start, so a bad password is a start error.

The connection (and its check: every primary answers PING with our
credentials) is made when the daemon starts, before any socket exists, so
``kvtier serve`` with a wrong password exits at once with one clear line
instead of serving engines a tier that cannot work. An unreachable cluster is
not a config error: the daemon starts with the tier degraded and retries. The
owner-side half (``RemoteOps``) is attached when the first register builds the
node (only then is the block size known).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Optional

from kvtier.tiers.remote import RemoteTier, connect_store

from .namespaces import Namespaces
from .node import Node
from .remote_config import RemoteConfig
from .remote_ops import RemoteOps

log = logging.getLogger("kvtier.remote")


def start_remote_tier(cfg: RemoteConfig, clock: Callable[[], float]) -> Optional[RemoteTier]:
    """The connected remote tier, or None when disabled. Raises ``RemoteError``
    (``RemoteAuthError`` for refused credentials) naming the cluster, never the password."""
    if not cfg.enabled:
        return None
    connect = connect_store(cfg.nodes, username=cfg.username, password=cfg.secret(), tls=cfg.tls,
                            tls_ca_file=cfg.tls_ca_file, tls_cert_file=cfg.tls_cert_file, tls_key_file=cfg.tls_key_file,
                            tls_verify=cfg.tls_verify, connect_timeout_s=cfg.connect_timeout_s, timeout_s=cfg.timeout_s,
                            chunk_bytes=cfg.chunk_bytes)
    tier = RemoteTier(connect, workers=cfg.workers, queue_depth=cfg.queue_depth, backoff_s=cfg.backoff_s,
                      backoff_max_s=cfg.backoff_max_s, clock=clock)
    if tier.store is None:
        log.warning("remote tier degraded from the start (lookups miss, engines recompute, retried): %s",
                    tier.last_error)
        return tier
    if cfg.capacity_bytes:
        why = tier.store.bound_memory(cfg.capacity_bytes)
        if why:
            log.warning("remote tier: %s", why)
    log.info("remote tier: Redis Cluster at %s, %d primaries, namespace %r", ", ".join(cfg.nodes),
             tier.store.primaries(), cfg.namespace)
    return tier


def attach_remote(node: Node, cfg: RemoteConfig, tier: RemoteTier, namespaces: Namespaces, counters: Counter[str],
                  clock: Callable[[], float]) -> None:
    """Give a freshly built node its remote half."""
    node.remote = RemoteOps(node.mgr, node.placement, cfg, tier,
                            lambda ns: (namespaces.name(ns), namespaces.geometry(ns)), counters, clock)


__all__ = ["start_remote_tier", "attach_remote"]
