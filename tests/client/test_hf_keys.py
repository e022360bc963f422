"""What a TieredCache's block keys promise: a key names its block's bytes, a sequence reads
the bytes it wrote, and a cache never acts in a client session other than its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvtier.bench.spawn import DaemonProcess  # noqa: E402
from kvtier.bench.workload import build_model  # noqa: E402
from kvtier.client.hf_cache import KVLayout, TieredCache, chain_key  # noqa: E402
from kvtier.client.replies import EngineReclaimed, KvtierError  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_model("tiny", seed=0)


def _sizes(layout: KVLayout) -> tuple[str, ...]:
    b = layout.block_bytes
    return f"tiers.hbm_bytes={b * 64}", f"tiers.dram_bytes={b * 16}", f"tiers.nvme_bytes={b * 128}"


@pytest.fixture
def engine(model, tmp_path):
    layout = KVLayout.from_config(model.config, 16)
    d = DaemonProcess(tmp_path, *_sizes(layout))
    c = d.client(engine_id="keys")
    c.register(block_bytes=layout.block_bytes, block_tokens=16, layout=layout.describe())
    yield c, layout
    c.check()
    c.close()
    assert d.stop() == 0


def fwd(model, ids, cache, feed=True):
    with torch.no_grad():
        if feed and isinstance(cache, TieredCache):
            cache.feed_tokens(ids)
        return model(input_ids=ids, cache=cache).logits


def both(model, ids, ref, tc, feed=True):
    a, b = fwd(model, ids, ref), fwd(model, ids, tc, feed)
    assert torch.equal(a, b)
    return a[:, -1:].argmax(-1)


def test_the_same_tokens_computed_in_other_chunks_keep_their_own_bytes(model, engine):
    """Token keys say "same tokens", not "same bytes": prefilled in chunks of 8, a prompt's K/V
    differs in the last bits from one prefill of it. B's blocks must not fold into A's, or
    B's next turn reads A's bytes; C, prefilled as A was, folds into A's blocks."""
    c, layout = engine
    prompt = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(11))
    a_cache = TieredCache(c, layout, seq_ids=[1])
    fwd(model, prompt, a_cache)
    a_cache.deactivate()
    ref, b_cache = DynamicCache(config=model.config), TieredCache(c, layout, seq_ids=[2])
    for chunk in prompt.split(8, dim=1):
        both(model, chunk, ref, b_cache)
    assert set(b_cache.rows[0].blocks).isdisjoint(a_cache.rows[0].blocks)
    assert b_cache.rows[0].keys == a_cache.rows[0].keys  # lookups by tokens still find A's
    b_cache.deactivate()  # the next turn gathers from the slots: B's own bytes
    both(model, torch.tensor([[7]]), ref, b_cache)
    c_cache = TieredCache(c, layout, seq_ids=[3])
    fwd(model, prompt, c_cache)
    assert c_cache.rows[0].blocks == a_cache.rows[0].blocks  # identical bytes still fold
    s = c.stats()
    assert s["service"]["seal_shared"] == 2 and s["io"]["events"]["seal_kept_distinct"] == 2
    a_cache.close()  # while C, active, pins the blocks they share: A frees only its reference
    c.check()
    c_cache.deactivate()
    fwd(model, torch.tensor([[7]]), c_cache)  # C's blocks are still there, and still its
    b_cache.close()
    c_cache.close()


def test_after_an_unfed_forward_a_row_s_blocks_are_keyed_by_their_bytes(model, engine):
    """Token ids are optional per forward; once one forward was not fed, the ids fed later
    are not those of the positions they would key. Two sequences with the same first turn
    (decode unfed) and different second turns must not share the second turn's blocks."""
    c, layout = engine
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 512, (1, 32), generator=g)
    first = [torch.randint(0, 512, (1, 16), generator=g) for _ in range(2)]
    tail = torch.randint(0, 512, (1, 16), generator=g)
    caches = []
    for seq, start in enumerate(first, 1):
        ref, tc = DynamicCache(config=model.config), TieredCache(c, layout, seq_ids=[seq])
        nxt = both(model, prompt, ref, tc)
        for _ in range(16):
            nxt = both(model, nxt, ref, tc, feed=False)
        tc.deactivate()
        both(model, torch.cat([start, tail], dim=1), ref, tc)
        tc.deactivate()
        both(model, torch.tensor([[9]]), ref, tc)
        assert tc.rows[0].known == 32 and tc.rows[0].tokens == prompt[0].tolist()  # what was fed later is dropped
        caches.append(tc)
    p, q = (t.rows[0].blocks for t in caches)
    assert p[:3] == q[:3]  # the same prompt and greedy decode: the same bytes
    assert set(p[3:]).isdisjoint(q[3:])
    for t in caches:
        t.close()


def test_a_prefix_with_too_few_token_ids_is_refused(model, engine):
    c, layout = engine
    with pytest.raises(ValueError, match="token ids for a prefix of 2 blocks"):
        TieredCache.from_prefix(c, layout, [11, 12], list(range(20)))


def test_a_forward_that_raised_midway_is_run_again_exactly(model, engine):
    """An exception in a layer after the first leaves that step's K/V in the gathered copy
    of the layers before it; the next forward must not build on it."""
    c, layout = engine
    ref, tc = DynamicCache(config=model.config), TieredCache(c, layout)
    nxt = both(model, torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(0)), ref, tc)
    hook = model.model.layers[1].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            fwd(model, nxt, tc)
    finally:
        hook.remove()
    for _ in range(3):
        nxt = both(model, nxt, ref, tc, feed=False)
    tc.close()


def test_a_cache_of_a_session_the_daemon_ended_refuses_to_act(model, tmp_path):
    """After a daemon restart and ``reattach``, a cache built before it holds ids and slots
    that a new cache may own now: it must refuse, not read or seal them."""
    layout = KVLayout.from_config(model.config, 16)
    d = DaemonProcess(tmp_path, *_sizes(layout))
    c = d.client(engine_id="stale", heartbeat_s=None)
    c.register(block_bytes=layout.block_bytes, block_tokens=16, layout=layout.describe())
    g = torch.Generator().manual_seed(1)
    old = TieredCache(c, layout, seq_ids=[1])
    fwd(model, torch.randint(0, 512, (1, 20), generator=g), old)
    old.deactivate()
    d.stop()
    d = DaemonProcess(tmp_path, *_sizes(layout))
    try:
        with pytest.raises(KvtierError):
            fwd(model, torch.tensor([[3]]), old)
        assert c.reattach(every_s=0)
        ref, new = DynamicCache(config=model.config), TieredCache(c, layout, seq_ids=[1])
        nxt = both(model, torch.randint(0, 512, (1, 20), generator=g), ref, new)
        new.deactivate()
        assert new.rows[0].blocks == old.rows[0].blocks  # the same ids, now the new cache's
        with pytest.raises(EngineReclaimed, match="session is over"):
            fwd(model, torch.tensor([[5]]), old)
        old.close()  # frees nothing of the new session's
        for _ in range(12):  # crosses a block boundary: seals block 1
            nxt = both(model, nxt, ref, new)
        new.close()
        c.check()
    finally:
        c.close()
        assert d.stop() == 0


def test_an_activate_that_fails_partway_leaves_no_pins(model, engine, monkeypatch):
    """Rows sharing blocks are acquired in parts: a part that fails must not leave the parts
    before it pinned (the cache is not active, so nothing would ever release them)."""
    c, layout = engine
    tc = TieredCache(c, layout)
    fwd(model, torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(5)), tc)
    tc.deactivate()
    blocks = tc.rows[0].blocks
    monkeypatch.setattr(tc, "_each_hold", lambda skip=frozenset(): [blocks[:1], blocks[1:]])
    real, calls = c.acquire, []

    def acquire(**kw):
        calls.append(kw)
        if len(calls) == 2:
            raise KvtierError("injected: acquire failed")
        return real(**kw)
    monkeypatch.setattr(c, "acquire", acquire)
    with pytest.raises(KvtierError, match="injected"):
        tc.activate()
    assert not tc.active and c.stats()["engines"][0]["pins"] == 0
    monkeypatch.undo()
    tc.close()


def _pins(c) -> int:
    return c.stats()["engines"][0]["pins"]


def _fail_call(monkeypatch, c, name: str, at: int) -> list:
    """Make the ``at``-th call of ``c.<name>`` raise (a fault the daemon could answer with)."""
    real, calls = getattr(c, name), []

    def call(*args, **kw):
        calls.append(kw)
        if len(calls) == at:
            raise KvtierError(f"injected: {name} failed")
        return real(*args, **kw)
    monkeypatch.setattr(c, name, call)
    return calls


def test_a_fold_whose_shared_block_cannot_be_pinned_leaves_a_sound_cache(model, engine, monkeypatch):
    """Two rows whose prompts start with A's fold four blocks into A's; pinning the third fails
    (a promotion that failed). The forward still stands (its K/V is computed), the rows name
    A's blocks, not the ones they released, the pins of the two folds already made and of the
    rows' own blocks are released, and the next forwards acquire them again, exactly."""
    c, layout = engine
    prompt = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(11))
    a_cache = TieredCache(c, layout, seq_ids=[1])
    fwd(model, prompt, a_cache)
    a_cache.deactivate()
    ids = torch.cat([prompt.repeat(2, 1), torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(2))], 1)
    calls = _fail_call(monkeypatch, c, "acquire", 3)
    ref, tc = DynamicCache(config=model.config), TieredCache(c, layout, batch_size=2, seq_ids=[3, 4])
    nxt = both(model, ids, ref, tc)
    monkeypatch.undo()
    assert len(calls) == 3 and [r.blocks[:2] for r in tc.rows] == [a_cache.rows[0].blocks] * 2
    assert not tc.active and _pins(c) == 0
    c.check()
    for _ in range(10):  # re-acquired at the next forward; the rows' third blocks are their own
        nxt = both(model, nxt, ref, tc)
    assert tc.active and [r.blocks[:2] for r in tc.rows] == [a_cache.rows[0].blocks] * 2
    tc.deactivate()
    tc.deactivate()
    assert _pins(c) == 0
    a_cache.close()
    tc.close()
    c.check()
    assert c.stats()["engines"][0]["live_blocks"] == 0


def test_a_seal_that_fails_after_another_row_folded_leaves_no_unpinned_block_in_use(model, engine, monkeypatch):
    """Row 0 folds into the blocks active cache A pins; row 1's seal then fails. Row 0 names
    A's blocks without a pin of its own, so the cache must not stay active (its deactivate
    would take A's pins: pins are counted per engine)."""
    c, layout = engine
    gen = [torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(s)) for s in (11, 12, 13)]
    a_cache = TieredCache(c, layout, batch_size=2, seq_ids=[1, 2])
    fwd(model, torch.cat(gen[:2]), a_cache)  # A stays active: 4 pins
    _fail_call(monkeypatch, c, "seal", 2)
    tc = TieredCache(c, layout, batch_size=2, seq_ids=[3, 4])
    with pytest.raises(KvtierError, match="injected"):
        fwd(model, torch.cat([gen[0], gen[2]]), tc)
    monkeypatch.undo()
    assert tc.rows[0].blocks == a_cache.rows[0].blocks and not tc.active and _pins(c) == 4
    tc.deactivate()
    a_cache.deactivate()  # A's own pins are all still there
    assert _pins(c) == 0
    a_cache.close()
    tc.close()
    c.check()


def test_a_release_that_fails_partway_is_finished_later(model, engine, monkeypatch):
    """Rows sharing blocks release in two requests; the second fails. The cache is not active
    (some slots are unpinned), and the next deactivate, activate or close makes the release
    left: no pin leaks, and close frees everything."""
    c, layout = engine
    tc = TieredCache(c, layout, batch_size=2, seq_ids=[3, 4])
    fwd(model, torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(11)).repeat(2, 1), tc)
    _fail_call(monkeypatch, c, "release", 2)
    with pytest.raises(KvtierError, match="injected"):
        tc.deactivate()
    monkeypatch.undo()
    assert tc.rows[1].blocks[:2] == tc.rows[0].blocks[:2]  # row 1's full blocks folded into row 0's
    assert not tc.active and _pins(c) == 2  # the second request: row 1's pins on the shared two
    fwd(model, torch.tensor([[1], [1]]), tc)  # activate releases them first, then pins afresh
    assert _pins(c) == 6
    tc.deactivate()
    assert _pins(c) == 0
    tc.close()
    c.check()
    assert c.stats()["engines"][0]["live_blocks"] == 0


def _fed_forward_raised(model, c, layout, layer: int):
    """A cache after a 15-token prompt, then a forward fed token 100 that raised in ``layer``
    (0: before the model reached the cache; 1: inside it)."""
    prompt = torch.randint(0, 512, (1, 15), generator=torch.Generator().manual_seed(1))
    tc = TieredCache(c, layout, seq_ids=[1])
    fwd(model, prompt, tc)
    hook = model.model.layers[layer].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            fwd(model, torch.tensor([[100]]), tc)
    finally:
        hook.remove()
    return prompt, tc


@pytest.mark.parametrize("raise_at", ["cache", "before"])
def test_ids_fed_for_a_forward_that_raised_key_nothing(model, engine, raise_at):
    """Ids fed for a forward that raised belong to no forward: an unfed retry of the same
    length must not key its block by them (a prefix lookup would then serve other bytes).
    Raised inside the cache, the next forward forgets them; raised before the model reached
    the cache, ``unfeed`` does."""
    c, layout = engine
    prompt, tc = _fed_forward_raised(model, c, layout, 1 if raise_at == "cache" else 0)
    if raise_at == "before":
        tc.unfeed()
    fwd(model, torch.tensor([[200]]), tc, feed=False)
    assert tc.rows[0].known == 15 and tc.rows[0].tokens == prompt[0].tolist()
    x_key = chain_key(0, np.asarray(prompt[0].tolist() + [100], dtype=np.int64).tobytes(), b"kvtier")
    assert tc.rows[0].keys[0] != x_key and c.lookup([x_key])[0][0] == -1
    tc.close()


def test_a_fed_retry_of_a_forward_that_raised_keeps_token_keys(model, engine):
    """The retry is fed its own ids after the failed forward's: they key its block."""
    c, layout = engine
    prompt, tc = _fed_forward_raised(model, c, layout, 1)
    fwd(model, torch.tensor([[200]]), tc)
    assert tc.rows[0].known == 16 and tc.rows[0].tokens == prompt[0].tolist() + [200]
    y_key = chain_key(0, np.asarray(prompt[0].tolist() + [200], dtype=np.int64).tobytes(), b"kvtier")
    assert tc.rows[0].keys[0] == y_key
    tc.close()


def test_a_block_kept_for_its_own_bytes_goes_with_its_last_reference(model, engine):
    """A block sealed out of the key index (other bytes than the key's block) is reached by
    no lookup: when its sequence frees it, it is released, not cached (it would take HBM,
    DRAM and NVMe room for nothing), and no KV event about the key's held block is sent."""
    c, layout = engine
    prompt = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(11))
    a_cache = TieredCache(c, layout, seq_ids=[1])
    fwd(model, prompt, a_cache)
    a_cache.deactivate()
    b_cache = TieredCache(c, layout, seq_ids=[2])
    for chunk in prompt.split(8, dim=1):
        fwd(model, chunk, b_cache)
    kept = b_cache.rows[0].blocks[:2]
    assert set(kept).isdisjoint(a_cache.rows[0].blocks)
    before = c.stats()["blocks"]
    b_cache.close()
    after = c.stats()["blocks"]
    assert after["cached"] == before["cached"]  # B's two sealed blocks did not become cached ones
    assert after["live"] == before["live"] - 2  # B's two kept blocks go
    assert c.lookup(a_cache.rows[0].keys)[0].tolist() == a_cache.rows[0].blocks  # A's are untouched
    a_cache.close()


def test_ids_of_a_forward_that_raised_are_dropped_by_deactivate_too(model, engine):
    """A deactivate between the failed forward and an unfed retry must not leave the failed
    forward's ids to key the retry's block."""
    c, layout = engine
    prompt, tc = _fed_forward_raised(model, c, layout, 1)
    tc.deactivate()
    fwd(model, torch.tensor([[200]]), tc, feed=False)
    assert tc.rows[0].known == 15 and tc.rows[0].tokens == prompt[0].tolist()
    tc.close()
