"""A Hugging Face transformers ``Cache`` whose K/V live in kvtier's paged HBM slots.

Each batch row is one sequence: a list of kvtier blocks, each holding
``block_tokens`` tokens of every layer's K and V in the block-major layout
``[layers, 2, kv_heads, block_tokens, head_dim]``. Per forward pass, layer 0
allocates blocks for the new tokens; every layer writes its new K/V into the
slots. The first forward of a turn gathers each layer's K/V from the pinned
slots; later forwards extend that gathered copy with the new K/V (pinned slots
cannot change, so the copy stays byte-identical), and ``deactivate`` drops it
with the pins. After the last layer, full blocks are sealed under content-chained keys (so sessions
that share a prompt share blocks). Between turns an idle cache releases its
pins (``deactivate``), so the daemon may demote its blocks to DRAM or NVMe;
``activate`` (implicit on the next forward) acquires them back, waiting for
promotions. The bytes attention reads are exactly the bytes written, so a
model produces the same bits as with ``DynamicCache``.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Optional, Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvtier.client.kv_layout import KVLayout, Row, chain_key, row_keys
from kvtier.client.replies import EngineReclaimed
from kvtier.client.tier_client import TierClient

log = logging.getLogger(__name__)


class TieredLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, owner: "TieredCache", layer_idx: int) -> None:
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.layer_update(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return -1


class TieredCache(Cache):
    def __init__(self, client: TierClient, layout: KVLayout, batch_size: int = 1, namespace: bytes = b"kvtier",
                 seq_ids: Optional[Sequence[Optional[int]]] = None) -> None:
        super().__init__(layers=[TieredLayer(self, i) for i in range(layout.num_layers)])
        if client.hbm is None:
            raise ValueError("the client has no HBM region mapped: register it first")
        self.client = client
        self.session = client.session  # the client session whose blocks and slots these are
        self.layout = layout
        self.namespace = namespace
        self.pool = layout.pool_view(client.hbm)
        self.rows = [Row() for _ in range(batch_size)]
        self.seq_ids = list(seq_ids) if seq_ids is not None else [None] * batch_size
        self.active = False
        self.segment: Optional[str] = None  # chat segment of the tokens being written (system/user/assistant)
        self._work: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None] * layout.num_layers
        self._where: list[tuple] = []
        self._fed: list[bool] = []  # per row: this forward's token ids were fed, in line with the last
        self._open_step = False  # a forward began (layer 0) and its last layer has not run yet
        self._open_q = 0  # ... and its tokens per row
        self._unreleased: list[list[int]] = []  # release requests a failure left unmade
        self.acquires = 0
        self.last_mass: Optional[torch.Tensor] = None

    # -- state ------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self.rows[0].length

    def all_blocks(self) -> list[int]:
        return [b for r in self.rows for b in r.blocks]

    def _settle(self) -> None:
        """On a GPU the model's reads and writes of the pool are queued on the current stream:
        they finish before a seal or a release lets the daemon move or reuse a slot."""
        if self.pool.is_cuda:
            torch.cuda.current_stream(self.pool.device).synchronize()

    def _each_hold(self, skip: frozenset = frozenset()) -> list[list[int]]:
        """Every row's blocks as requests without repeats: rows that share a prefix hold its
        blocks once each (a pin and a reference per row), and a request names a block once.
        ``skip`` leaves out (row, index) places that hold no pin."""
        out: list[list[int]] = []
        seen: Counter = Counter()
        for i, row in enumerate(self.rows):
            for j, b in enumerate(row.blocks):
                if (i, j) in skip:
                    continue
                k = seen[b]
                seen[b] += 1
                if k == len(out):
                    out.append([])
                out[k].append(b)
        return out

    def feed_tokens(self, token_ids: torch.Tensor) -> None:
        """Token ids of the next forward ([batch, q]); keys chain over tokens, as in vLLM, while
        every forward of a row was fed: after one that was not, its later blocks are keyed by
        their K/V bytes (ids no longer say which positions they are)."""
        for row, ids in zip(self.rows, token_ids.tolist()):
            row.tokens.extend(int(t) for t in ids)

    def unfeed(self) -> None:
        """Forget ids fed for a forward that raised before it reached the cache."""
        for row in self.rows:
            del row.tokens[row.known:]

    @classmethod
    def from_prefix(cls, client: TierClient, layout: KVLayout, keys: Sequence[int], tokens: Sequence[int],
                    namespace: bytes = b"kvtier", seq_id: Optional[int] = None) -> "TieredCache":
        """A one-row cache that starts from sealed prefix blocks another sequence wrote."""
        if len(tokens) and len(tokens) < len(keys) * layout.block_tokens:
            raise ValueError(f"{len(tokens)} token ids for a prefix of {len(keys)} blocks of "
                             f"{layout.block_tokens} tokens (give them all, or none)")
        cache = cls(client, layout, 1, namespace, [seq_id])
        blocks = client.ref(list(keys), seq=seq_id)
        if np.any(blocks < 0):
            client.free(blocks=blocks[blocks >= 0])
            raise KeyError("a prefix block is no longer cached")
        row = cache.rows[0]
        row.blocks, row.keys = blocks.tolist(), list(keys)
        row.slots = [-1] * len(row.blocks)
        row.length = len(keys) * layout.block_tokens
        row.tokens = list(tokens)[: row.length]
        row.known = len(row.tokens)  # none given: the blocks after the prefix are keyed by K/V bytes
        return cache

    # -- residency ----------------------------------------------------------------
    def _check_session(self) -> None:
        """A cache lives in one client session: after a ``reattach`` its block ids and slots
        may be another sequence's, so using them would read or seal that one's bytes."""
        if self.client.session != self.session:
            raise EngineReclaimed("unknown_engine", "this cache's client session is over: build a new cache")

    def activate(self) -> None:
        """Acquire (pin) every block of every row; waits for promotions."""
        self._check_session()
        self._flush_releases()  # pins a failed release left: released before any is taken again
        slot_of: dict[int, int] = {}
        done: list[list[int]] = []
        try:
            for part in self._each_hold():
                got, slots = self.client.acquire(blocks=part)
                done.append(part)
                slot_of |= dict(zip(got.tolist(), slots.tolist()))
        except BaseException:  # the parts acquired already are released: not active, no pins
            for part in done:
                try:
                    self.client.release(blocks=part)
                except Exception:  # noqa: BLE001 - the first error is the one to raise
                    pass
            raise
        if slot_of:
            for row in self.rows:
                row.slots = [slot_of[b] for b in row.blocks]
            self.acquires += 1
        self.active = True

    def deactivate(self) -> None:
        """Release the pins: the daemon may now demote these blocks while the sequence idles."""
        if self.active:
            self._release_pins()
        else:
            self._flush_releases()
        self._drop_open_step()
        self.active = False
        self._work = [None] * self.layout.num_layers

    def hint(self, deadline_s: float = 0.0) -> None:
        """Ask the daemon to bring this cache's blocks back before ``deadline_s``."""
        blocks = sorted(set(self.all_blocks()))
        if blocks:
            self.client.hint(blocks=blocks, deadline_s=deadline_s)

    def close(self) -> None:
        """End of the sequences: release and free every block (an ended session's are gone)."""
        self.deactivate()
        if self.client.session == self.session:
            for part in self._each_hold():
                self.client.free(blocks=part)
        for row in self.rows:
            row.blocks, row.slots, row.keys = [], [], []

    # -- the forward pass ----------------------------------------------------------------
    def _grow(self, q_len: int) -> None:
        T = self.layout.block_tokens
        for i, row in enumerate(self.rows):
            need = -(-(row.length + q_len) // T) - len(row.blocks)
            if need <= 0:
                continue
            new, slots = self.client.alloc(need, seq=self.seq_ids[i], pin=True)  # pinned: written next
            row.blocks.extend(new.tolist())
            row.slots.extend(slots.tolist())
            if self.segment:  # a block is tagged by the segment that starts it
                self.client.report_segment(new, self.segment)

    def layer_update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_len = keys.shape[-2]
        if keys.shape[0] != len(self.rows):
            raise ValueError(f"batch of {keys.shape[0]} rows, cache built for {len(self.rows)}")
        if layer == 0:
            self._check_session()
            self._drop_open_step()
            self._open_step, self._open_q = True, q_len  # before anything here can raise
            self._fed = [self._take_fed(row, q_len) for row in self.rows]
            if not self.active:
                self.activate()
            self._grow(q_len)
            self._where = [self._token_places(row, q_len) for row in self.rows]
        for i, where in enumerate(self._where):  # the slots are the truth: every new K/V lands there
            if q_len == 1:  # one token (decode): plain slicing, no scatter
                slot, off = where
                self.pool[slot, layer, 0, :, off, :] = keys[i, :, 0, :]
                self.pool[slot, layer, 1, :, off, :] = values[i, :, 0, :]
            else:
                tok_slot, tok_off = where
                self.pool[tok_slot, layer, 0, :, tok_off, :] = keys[i].transpose(0, 1).to(self.layout.dtype)
                self.pool[tok_slot, layer, 1, :, tok_off, :] = values[i].transpose(0, 1).to(self.layout.dtype)
        work = self._work[layer]
        if work is None:  # first step of a turn: one gather from the pinned slots
            k, v = self._gather(layer, q_len)
        else:  # later steps: the pinned slots cannot change, so extend the gathered copy
            k = torch.cat([work[0], keys.to(work[0].dtype)], dim=-2)
            v = torch.cat([work[1], values.to(work[1].dtype)], dim=-2)
        self._work[layer] = (k, v)
        if layer == self.layout.num_layers - 1:
            self._end_step(q_len)
        return k, v

    def _drop_open_step(self) -> None:
        """The last forward raised in the cache: its K/V is in the gathered copy, not in the rows'
        lengths, and the ids it was fed are no forward's (a retry's, fed since, follow them)."""
        if not self._open_step:
            return
        self._work = [None] * self.layout.num_layers
        for row, fed in zip(self.rows, self._fed):
            if fed:
                del row.tokens[row.known: row.known + self._open_q]
        self._open_step = False

    @staticmethod
    def _take_fed(row: Row, q_len: int) -> bool:
        """Were exactly this forward's token ids fed, after those of every earlier one? If not,
        the row's token ids stop at ``known`` for good (what was fed since is dropped)."""
        if row.known == row.length and len(row.tokens) == row.length + q_len:
            return True
        del row.tokens[row.known:]
        return False

    def _token_places(self, row: Row, q_len: int) -> tuple:
        """(slot, offset) of the new tokens of ``row``: ints for one token, index tensors for more."""
        T = self.layout.block_tokens
        if q_len == 1:
            return row.slots[row.length // T], row.length % T
        pos = torch.arange(row.length, row.length + q_len)
        return torch.as_tensor(row.slots, dtype=torch.long)[pos // T], pos % T

    def _gather(self, layer: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's K/V, [B, H, S, D] each, contiguous: the layer's blocks, then their tokens."""
        T, H, D = self.layout.block_tokens, self.layout.num_kv_heads, self.layout.head_dim
        if len(lengths := {row.length + q_len for row in self.rows}) != 1:
            raise RuntimeError(f"rows of different lengths in one batch: {sorted(lengths)} tokens")
        full, rest = divmod(n := lengths.pop(), T)
        layer_pool = self.pool[:, layer]  # a view: [slots, 2, H, T, D]
        k, v = (torch.empty(len(self.rows), H, n, D, dtype=self.pool.dtype, device=self.pool.device) for _ in range(2))
        for i, row in enumerate(self.rows):
            idx = torch.as_tensor(row.slots[: full + (rest > 0)], dtype=torch.long, device=self.pool.device)
            kv = torch.index_select(layer_pool, 0, idx)  # [blocks, 2, H, T, D]
            for out, part in ((k[i], kv[:, 0]), (v[i], kv[:, 1])):  # part: [blocks, H, T, D]
                if full:
                    out[:, : full * T].view(H, full, T, D).copy_(part[:full].permute(1, 0, 2, 3))
                if rest:
                    out[:, full * T:].copy_(part[full, :, :rest])
        return k, v

    def _end_step(self, q_len: int) -> None:
        """The step is in the slots: count it, then seal every row's newly full blocks."""
        self._open_step = False
        for i, row in enumerate(self.rows):
            row.length += q_len
            if self._fed[i]:
                row.known = row.length
        folded: list[tuple[int, int]] = []
        try:
            for i, row in enumerate(self.rows):
                folded += [(i, j) for j in self._seal_full(i, row)]
        except BaseException:  # a row named a shared block it holds no pin on: not all pinned now
            self._release_pins(skip=frozenset(folded))
            raise
        self._pin_folded(folded)

    def _seal_full(self, i: int, row: Row) -> list[int]:
        """Seal ``row``'s full blocks not sealed yet; returns the indices of those folded into a
        shared block, which the row now names (its reference moved there; not pinned yet)."""
        T = self.layout.block_tokens
        todo = list(range(len(row.keys), row.length // T))
        if not todo:
            return []
        by_kv = [j for j in todo if row.known < (j + 1) * T]  # no token ids (e.g. generate())
        keys = row_keys(row, todo, T, dict(zip(by_kv, self._block_bytes([row.slots[j] for j in by_kv]))),
                        self.namespace)
        blocks = [row.blocks[j] for j in todo]
        self._settle()  # the step's writes are in the slots before the daemon may move them
        # fold only into a block of the same bytes: this sequence goes on reading its own K/V
        # (the same tokens computed in other chunks or batches differ in the last bits)
        canon = self.client.seal(blocks, keys, seq=self.seq_ids[i], fold_identical_only=True).tolist()
        row.keys.extend(keys)
        folded = []
        for j, b, c in zip(todo, blocks, canon):
            if c != b:  # ours was released into the shared block: the row names that one now
                row.blocks[j], row.slots[j] = c, -1
                folded.append(j)
        return folded

    def _pin_folded(self, folded: list[tuple[int, int]]) -> None:
        """Pin and map the shared blocks rows were folded into. If one cannot be pinned (it was
        demoted and its promotion failed), the step still stands (its K/V is in the gathered
        copy, identical bytes), but the cache is no longer all pinned: every other pin is
        released and the next forward acquires the rows again, or raises before it computes."""
        for n, (i, j) in enumerate(folded):
            row = self.rows[i]
            try:
                _, slots = self.client.acquire(blocks=[row.blocks[j]])
            except BaseException as err:  # reported (or raised), and the cache re-acquires
                self._release_pins(skip=frozenset(folded[n:]))
                if not isinstance(err, Exception) or isinstance(err, EngineReclaimed) or self.client.reclaimed:
                    raise
                log.warning("shared block %d could not be pinned after a fold (%s): the cache "
                            "released its pins and acquires its rows again at the next forward",
                            row.blocks[j], err)
                return
            row.slots[j] = int(slots[0])

    def _release_pins(self, skip: frozenset = frozenset()) -> None:
        """Not active any more: release every pin held (all places but ``skip``). Requests not
        made because one failed stay in ``_unreleased``, made first by the next activate,
        deactivate or close (the cache is not active meanwhile: its slots may move)."""
        self.active = False
        self._work = [None] * self.layout.num_layers  # unpinned slots may move: drop the gathered copy
        self._settle()
        self._unreleased = self._each_hold(skip)
        self._flush_releases()

    def _flush_releases(self) -> None:
        """Make the releases a failure left (none once the session is over: its pins went with it)."""
        if self.client.session != self.session or self.client.reclaimed:
            self._unreleased = []
        while self._unreleased:
            self.client.release(blocks=self._unreleased[0])
            self._unreleased.pop(0)

    def _block_bytes(self, slots: list[int]) -> list[bytes]:
        """The K/V bytes of ``slots`` for their keys. A device pool is copied to the host
        explicitly, one copy for all of them (a numpy view of a device tensor raises),
        so a CUDA pool keys a block exactly as a host pool does (same bytes, same key)."""
        if not slots:
            return []
        rows = self.pool[torch.as_tensor(slots, dtype=torch.long, device=self.pool.device)]
        host = rows.contiguous().view(torch.uint8).cpu().numpy()
        return [host[i].tobytes() for i in range(len(slots))]

    # -- transformers Cache API ---------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.length + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("TieredCache does not crop: sealed blocks are immutable")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("TieredCache does not support beam search")


__all__ = ["KVLayout", "TieredCache", "chain_key"]
