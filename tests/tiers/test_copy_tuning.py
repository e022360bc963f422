"""Choosing the host copy loop (``tiers/copy_tuning.py``): every loop the CPU runs is timed
on the DRAM pool and the fastest taken; a named loop is set or refused before anything
changes; a pool holding blocks is never used as scratch."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.tiers import copy_tuning
from kvtier.tiers.copy_tuning import LOOPS, check_loop, choose_copy_loop, current_choice, current_loop, runnable_loops
from kvtier.tiers.hostcopy import HostCopier
from kvtier.tiers.manager import TierManager
from kvtier.tiers.types import Tier

pytestmark = pytest.mark.skipif(not runnable_loops(), reason="the compiled copy (kernels/_copy.c) was not built")
MiB = 1 << 20


@pytest.fixture(autouse=True)
def restore_loop():
    from kvtier.kernels import _copy

    before = _copy.streaming()
    yield
    _copy.use_streaming(before)


def _big_enough() -> int:
    """DRAM pool bytes the tuning times copies on (twice the copy it needs, past the caches)."""
    need = max(copy_tuning.MIN_BYTES, copy_tuning._last_level_cache_bytes())
    if need > copy_tuning.MAX_BYTES:
        pytest.skip(f"the last-level cache ({need >> 20} MiB) is larger than any copy the tuning times")
    return 2 * need


def test_auto_times_every_loop_the_cpu_runs_and_sets_the_fastest():
    block = 1 * MiB
    m = TierManager(block, 4, _big_enough() // block, 0, recover=False)
    try:
        choice = m.tune_copy_loop("auto")
        assert choice.how == "measured" and set(choice.median_ms) == set(runnable_loops())
        assert choice.copy_bytes >= copy_tuning.MIN_BYTES and all(v > 0 for v in choice.median_ms.values())
        fastest = min(choice.median_ms.values())
        assert choice.median_ms[choice.loop] <= fastest * (1 + copy_tuning.KEEP_WITHIN) + 1e-3
        assert current_loop() == choice.loop and m.copy_loop is choice
        # the pool is scratch only while empty: after it, copies through the chosen loop stay exact
        b = m.alloc(1)[0]
        payload = np.random.default_rng(3).integers(0, 255, block, dtype=np.uint8)
        m.write(int(b), payload)
        m.seal(int(b), 77)
        m.demote(np.array([b]), Tier.HBM, Tier.DRAM)
        m.wait()
        m.promote(np.array([b]), Tier.HBM)
        m.wait()
        assert m.read(int(b)) == payload.tobytes()
        m.check_invariants()
    finally:
        m.close()


def test_the_rule_takes_the_fastest_unless_the_loop_in_use_is_within_the_margin(monkeypatch):
    loops = runnable_loops()
    if len(loops) < 2:
        pytest.skip("one loop only")
    now, other = current_loop(), next(k for k in loops if k != current_loop())
    pool = np.zeros(_big_enough(), np.uint8)
    copier = HostCopier(2)
    try:
        for other_ms, want in ((0.5, other), (0.99, now)):  # 50% faster: taken; 1% faster: noise
            monkeypatch.setattr(copy_tuning, "_time_loops",
                                lambda c, p, size, ks, rounds, o=other_ms: {k: (o if k == other else 1.0) for k in ks})
            choice = choose_copy_loop(copier, pool, "auto")
            assert (choice.loop, current_loop()) == (want, want)
            copy_tuning._copy.use_streaming(now)
    finally:
        copier.close()


def test_a_pool_too_small_to_time_keeps_the_loop_and_says_why():
    now = current_loop()
    choice = choose_copy_loop(HostCopier(1), np.zeros(8 * MiB, np.uint8), "auto")
    assert choice.loop == now == current_loop() and choice.how.startswith("default: the DRAM pool (8 MiB) is too small")
    assert not choice.median_ms


def test_a_named_loop_is_set_and_one_the_cpu_lacks_or_unknown_is_refused_before_anything_changes():
    loops = runnable_loops()
    for k in loops:
        choice = choose_copy_loop(None, None, k)
        assert choice.how == "configured" and current_loop() == k and current_choice() is choice
    now = current_loop()
    for bad in ["sse9", *[k for k in LOOPS if k not in loops]]:
        with pytest.raises(ValueError, match="tiers.copy_loop"):
            check_loop(bad)
        with pytest.raises(ValueError, match="tiers.copy_loop"):
            choose_copy_loop(None, None, bad)
        assert current_loop() == now


def test_a_pool_that_holds_a_block_is_never_scratch():
    block = 1 * MiB
    m = TierManager(block, 4, _big_enough() // block, 0, recover=False)
    try:
        b = int(m.alloc(1)[0])
        payload = np.random.default_rng(4).integers(0, 255, block, dtype=np.uint8)
        m.write(b, payload)
        m.seal(b, 78)
        m.demote(np.array([b]), Tier.HBM, Tier.DRAM)
        m.wait()
        now, record = current_loop(), m.copy_loop
        with pytest.raises(RuntimeError, match="holds blocks"):
            m.tune_copy_loop("auto")
        assert current_loop() == now and m.copy_loop == record
        m.promote(np.array([b]), Tier.HBM)
        m.wait()
        assert m.read(b) == payload.tobytes()
    finally:
        m.close()


def test_a_cache_larger_than_the_usual_copy_is_outgrown_not_given_up(monkeypatch):
    """Copies must run past the last-level cache: where it is larger than the usual 128 MiB,
    the copies grow to twice it (fewer rounds), and only a pool too small for that is refused."""
    seen = {}

    def fake(copier, pool, size, loops, rounds):
        seen.update(size=size, rounds=rounds)
        return {k: 1.0 for k in loops}

    monkeypatch.setattr(copy_tuning, "_time_loops", fake)
    copier = HostCopier(1)
    try:
        for cache_mib, pool_mib, size_mib, rounds in ((32, 1024, 128, 5), (80, 1024, 160, 4), (320, 1024, 512, 2),
                                                      (320, 4096, 640, 2)):
            monkeypatch.setattr(copy_tuning, "_last_level_cache_bytes", lambda c=cache_mib: c * MiB)
            seen.clear()
            choice = choose_copy_loop(copier, np.zeros(pool_mib * MiB, np.uint8), "auto")  # never touched: faked
            assert choice.how == "measured" and seen == {"size": size_mib * MiB, "rounds": rounds}, cache_mib
        monkeypatch.setattr(copy_tuning, "_last_level_cache_bytes", lambda: 320 * MiB)
        choice = choose_copy_loop(copier, np.zeros(512 * MiB, np.uint8), "auto")
        assert choice.how.startswith("default: the DRAM pool (512 MiB) is too small") and "320 MiB" in choice.how
    finally:
        copier.close()


def test_without_the_compiled_kernel_none_is_numpys_copy_and_the_rest_is_refused(monkeypatch):
    monkeypatch.setattr(copy_tuning, "_copy", None)
    check_loop("none")
    assert choose_copy_loop(None, None, "none").loop == "numpy"
    with pytest.raises(ValueError, match="the compiled copy kernel was not built"):
        check_loop("avx2")
    assert choose_copy_loop(None, None, "auto").how == "default: no compiled host copy to time"


def test_the_config_refuses_an_unknown_loop():
    from kvtier.daemon.config import load_config

    assert load_config(environ={}).tiers.copy_loop == "auto"
    with pytest.raises(Exception, match="copy_loop"):
        load_config(environ={}, overrides=["tiers.copy_loop=\"sse9\""])
