"""What goes to the shared remote tier: a placement decision, not a write-through.

A block is worth publishing when other nodes are likely to ask for it. What a
node can see of that is reuse across its own sequences: a sealed block whose
key another sequence also produced (a seal that folded into it) or looked up
(a ``ref`` of its key) is a shared prefix (a system prompt, a few-shot
template, a document many requests quote), and shared prefixes are what the
fleet's other nodes will see too. Private blocks (one conversation's own
turns) stay local: three quarters of blocks in chat traces are never reused at
all, and publishing them would fill the cluster and the network with bytes
nobody reads.

The rule (``PublishRule.select``), all vectorised over a batch of candidates:

- sealed, its key indexed (not detached), not corrupt, not published by this
  node already (a copy there is as good as ours: blocks are content-addressed);
- reused by at least ``min_shares`` other sequences on this node;
- and worth a slot by the value model: the admission verdict of the policy of
  the tier a remote copy refills (DRAM: ``Policy.admit_many``, the interface
  every policy implements), so a block the model rates below the victims it
  would displace is not worth the fleet's memory either.

Candidates are offered when a block crosses the sharing threshold and when it
lands in DRAM (a demotion: the moment the value model looked at it again).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kvtier.policy.base import Policy
from kvtier.tiers.block_table import BlockTable
from kvtier.tiers.types import SEALED


class PublishRule:
    def __init__(self, min_shares: int, policy: Optional[Policy]) -> None:
        self.min_shares = int(min_shares)
        self.policy = policy  # the DRAM tier's (None: no value model below HBM, every shared block qualifies)

    def wanted(self, shares: np.ndarray) -> np.ndarray:
        """Per block: shared enough to be a candidate at all (cheap, before the value model)."""
        return shares >= self.min_shares

    def select(self, t: BlockTable, blocks: np.ndarray, shares: np.ndarray, published: np.ndarray,
               corrupt: np.ndarray, classes: np.ndarray) -> np.ndarray:
        """Per block of ``blocks``: publish it now (see the module docstring)."""
        ok = (t.state[blocks] == SEALED) & ~t.detached[blocks] & ~corrupt[blocks] & ~published[blocks]
        ok &= self.wanted(shares[blocks])
        if self.policy is not None and ok.any():
            idx = np.flatnonzero(ok)
            ok[idx] = self.policy.admit_many(blocks[idx], classes[idx])
        return ok


__all__ = ["PublishRule"]
