"""The compiled kernels refuse or contain inputs a direct call can pass: no read or write
outside a buffer, no silent wrong copy. Each case runs in a child process, so an
interpreter crash fails its own test and nothing else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

_CAPTURE = textwrap.dedent('''
    import numpy as np
    from kvtier.kernels._replay import run as real_run
    from kvtier.policy import make_policy, value_compiled
    from kvtier.replay.sim import simulate
    from kvtier.replay.synthetic import synthetic_trace

    def captured():
        """The arrays and registers value_compiled packs for a warm zipf replay."""
        tr = synthetic_trace("zipf", requests=400)
        p = make_policy("kvtier", max(2, int(0.05 * tr.n_unique)), tr.n_unique, refresh_every=100)
        simulate(p, tr)
        got = {}

        def grab(arrays, ints, floats, start, stop):
            got.update(arrays=list(arrays), ints=ints.copy(), floats=floats.copy(), start=start, stop=stop)
            raise KeyboardInterrupt

        value_compiled._run = grab
        try:
            p.compiled_replay(tr.block, tr.cls, np.isin(np.arange(tr.n_unique), p.residents()))(0, len(tr.block))
        except KeyboardInterrupt:
            pass
        value_compiled._run = real_run
        return got

    def call(g):
        return real_run(tuple(g["arrays"]), g["ints"], g["floats"], g["start"], g["stop"])
''')


def _child(body: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-c", _CAPTURE + textwrap.dedent(body)], capture_output=True,
                          text=True, timeout=240)


def _register(name: str) -> int:
    """A register's index, from the kernel's own header (the enum's order)."""
    import pathlib
    import re

    import kvtier.kernels as k

    text = (pathlib.Path(k.__file__).parent / "replay_state.h").read_text()
    enum = re.search(r"enum\s*\{([^}]*\b" + name + r"\b[^}]*)\}", text)
    assert enum is not None, name
    names = [n.strip().split("=")[0].strip() for n in enum.group(1).split(",") if n.strip()]
    return names.index(name)


def test_copy_rows_refuses_rows_outside_either_buffer_before_a_byte_moves():
    """copy_rows / start_rows find their runs in C: a row number outside either buffer (one
    past the end, negative, past a buffer that is not a whole number of rows), counts that
    differ, a row size or piece size of zero or less, or row numbers not int64 (an int32 array
    of the right byte length, plain bytes), copy nothing and raise. A thread count below one or
    past the pool's helpers copies all the same."""
    r = _child('''
        from kvtier.kernels._copy import copy_rows, start_rows
        row = 4096
        d, s = np.zeros(16 * row + 100, np.uint8), np.ones(8 * row, np.uint8)
        i64 = lambda *x: np.array(x, np.int64)
        for fn in (copy_rows, start_rows):
            for dr, sr in (((0, 16), (0, 1)), ((0, 1), (0, 8)), ((0, -1), (0, 1)), ((0, 1), (-1, 2)),
                           ((0, 1 << 60), (0, 1))):  # a good row first: it must not be copied either
                try:
                    fn(d, s, i64(*dr), i64(*sr), row, 1 << 20, 2)
                    raise SystemExit(f"copied {dr, sr}")
                except IndexError:
                    pass
                assert not d.any(), (dr, sr)
            for args in ((i64(0, 1), i64(0), row), (i64(0), i64(0), 0), (i64(0), i64(0), -row),
                         (i64(0).astype(np.int32), i64(0), row),
                         (np.array([0, 0, 3, 0], np.int32), i64(0, 1), row),  # 16 bytes, not two int64s
                         (i64(0), b"\\0" * 8, row)):
                try:
                    fn(d, s, *args, 1 << 20, 2)
                    raise SystemExit(f"copied {args}")
                except ValueError:
                    pass
                assert not d.any()
            for piece in (0, -5):
                try:
                    fn(d, s, i64(0), i64(0), row, piece, 2)
                    raise SystemExit(f"copied {args}")
                except ValueError:
                    pass
                assert not d.any()
        assert copy_rows(d, s, i64(15, 3), i64(7, 0), row, 1 << 20, 2) == 2 * row
        assert d[15 * row: 16 * row].all() and d[3 * row: 4 * row].all() and int(d.sum()) == 2 * row
        assert copy_rows(d, s, i64(), i64(), row, 1 << 20, 2) == 0
        for threads in (-3, 10_000):  # no helper, or helpers capped
            d[:] = 0
            assert copy_rows(d, s, i64(1), i64(2), row, 1 << 20, threads) == row
            assert d[row: 2 * row].all() and int(d.sum()) == row
        print("ok")
    ''')
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-800:]


def test_copies_after_a_fork_and_from_two_threads_at_once_are_exact():
    """A forked child has none of its parent's helper threads: its copies start their own.
    Two callers at once: one gets the helpers, the other copies alone; both exact."""
    r = _child('''
        import os, threading
        from kvtier.kernels._copy import copy_rows
        n = 64 << 20
        src = np.random.default_rng(3).integers(0, 255, n, dtype=np.uint8)
        row0 = np.array([0], np.int64)

        def copy_and_check(out):
            d = np.zeros(n, np.uint8)
            out.append(copy_rows(d, src, row0, row0, n, 1 << 20, 2) == n and np.array_equal(d, src))

        first = []
        copy_and_check(first)  # the parent's helpers exist now
        stop, busy = threading.Event(), []
        def keep_copying():
            while not stop.is_set():
                copy_and_check(busy)
        bg = threading.Thread(target=keep_copying)
        bg.start()  # a fork while another thread copies: the child inherits no held lock
        statuses = []
        for _ in range(5):
            pid = os.fork()
            if pid == 0:
                got = []
                copy_and_check(got)
                # the child's own helper started (a stale count of the parent's would start none)
                helpers = len(os.listdir("/proc/self/task")) - 1 if os.path.isdir("/proc/self/task") else 1
                os._exit(0 if got == [True] and helpers == 1 else 3)
            statuses.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        stop.set()
        bg.join()
        results = []
        threads = [threading.Thread(target=copy_and_check, args=(results,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert first == [True] and statuses == [0] * 5 and all(busy) and results == [True] * 4
        print("ok")
    ''')
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-800:]


def test_a_copy_in_flight_across_a_fork_fails_in_the_child_and_lands_in_the_parent():
    """The child has none of the threads copying a job started before the fork: joining it
    there raises (or, had it finished before the fork, returns its bytes, all landed); it
    never hangs. The parent's join is unaffected."""
    r = _child('''
        import os
        from kvtier.kernels._copy import start_rows
        n = 256 << 20
        src = np.full(n, 7, np.uint8)
        for _ in range(3):
            dst = np.zeros(n, np.uint8)
            job = start_rows(dst, src, np.array([0], np.int64), np.array([0], np.int64), n, 1 << 20, 2)
            pid = os.fork()
            if pid == 0:
                try:
                    code = 0 if job.join() == n and bool((dst == 7).all()) else 3
                except RuntimeError as e:
                    code = 0 if "across a fork" in str(e) else 4
                os._exit(code)
            assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
            assert job.join() == n and bool((dst == 7).all())
        print("ok")
    ''')
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-800:]


def test_a_started_copy_is_copied_by_its_joiner_when_no_helper_can_start():
    """No thread can be made (an address-space limit here; a pids limit in a container): a
    started copy waits for no helper that does not exist, its join copies it."""
    r = _child('''
        import resource
        from kvtier.kernels._copy import start_rows, copy_rows
        n = 8 << 20
        s, d = np.ones(n, np.uint8), np.zeros(n, np.uint8)
        row0 = np.array([0], np.int64)
        args = (d, s, row0, row0, n, 1 << 20)
        assert start_rows(*args, 0).join() == n  # every allocation path warmed, no thread made
        d[:] = 0
        size = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 10), resource.RLIM_INFINITY))
        try:
            job = start_rows(*args, 2)
        except MemoryError:  # the interpreter itself needed more: nothing shown either way
            print("inconclusive")
            raise SystemExit(0)
        assert job.join() == n and bool(d.all())
        d[:] = 0
        assert copy_rows(*args, 2) == n and bool(d.all())
        print("ok")
    ''')
    if "inconclusive" in r.stdout:
        pytest.skip("the interpreter could not allocate under the address-space limit")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-800:]


def test_a_piece_larger_than_any_run_copies_every_run_whole():
    r = _child('''
        from kvtier.kernels._copy import copy_rows
        s = np.arange(64, dtype=np.uint8)
        rows = np.array([0, 2, 3, 5, 6, 7, 9, 10, 11, 12], np.int64)  # runs of 1, 2, 3 and 4 rows
        for piece in (2**63 - 1, 2**63 - 2, 2**62, 100, 3):
            d = np.zeros(64, np.uint8)
            assert copy_rows(d, s, rows, rows, 4, piece, 2) == 40, piece
            want = np.zeros(64, np.uint8)
            for r in rows:
                want[4 * r: 4 * r + 4] = s[4 * r: 4 * r + 4]
            assert np.array_equal(d, want), piece
        print("ok")
    ''')
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-800:]


def test_rows_within_one_buffer_are_copied_in_order_as_memmove_would():
    """Source and destination sharing bytes (two views of one buffer, rows a few bytes or
    many rows apart): each run of consecutive rows as memmove, in order (pieces in parallel
    would read bytes another piece had written); a started copy refuses them."""
    r = _child('''
        from kvtier.kernels._copy import copy_rows, start_rows, use_streaming, streaming_kinds
        kinds = streaming_kinds()
        rng = np.random.default_rng(4)
        row = 4096
        i64 = lambda x: np.array(x, np.int64)
        for kind in kinds:
            use_streaming(kind)
            for shift in (1, 100, 4096, 1 << 20, -(1 << 20), -3):
                buf = rng.integers(0, 255, 8 << 20, dtype=np.uint8)
                dst, src = buf[max(shift, 0):], buf[max(-shift, 0):]
                # a run of 1280 rows (5 MiB), then one of 2 rows, then one row
                drows = i64([*range(256, 1536), 1700, 1701, 1600])
                srows = i64([*range(256, 1536), 1750, 1751, 1537])
                want = buf.copy()
                wd, ws = want[max(shift, 0):], want[max(-shift, 0):]
                for d0, s0, n in ((256, 256, 1280), (1700, 1750, 2), (1600, 1537, 1)):
                    wd[d0 * row:(d0 + n) * row] = ws[s0 * row:(s0 + n) * row].copy()
                assert copy_rows(dst, src, drows, srows, row, 1 << 16, 2) == drows.size * row
                assert np.array_equal(buf, want), (kind, shift)
                try:
                    start_rows(dst, src, drows, srows, row, 1 << 16, 2)
                    raise SystemExit("started")
                except ValueError:
                    pass
        print("ok")
    ''')
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-800:]


@pytest.mark.parametrize("policy", ["normal", "idle"])
def test_helpers_spread_over_the_process_cpus_whoever_starts_them(policy):
    """A thread pinned to one CPU starting the first copy: its helpers (which would inherit
    its mask) still take one CPU each of the process's set, and are batch threads (a wake-up
    does not preempt the thread that started the copy) where the process runs the normal
    policy; under SCHED_IDLE as a child of ``chrt -i``, they stay idle."""
    prefix: tuple[str, ...] = ()
    if policy == "idle":
        if shutil.which("chrt") is None:
            pytest.skip("no chrt to start a process under SCHED_IDLE")
        prefix = ("chrt", "-i", "0")
    r = _child('''
        import os, threading
        from kvtier.kernels._copy import copy_rows
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            print("ok (one cpu)")
            raise SystemExit(0)
        before = set(os.listdir("/proc/self/task"))
        def pinned_copy():
            os.sched_setaffinity(0, {cpus[0]})
            n = 4 << 20
            d, s = np.zeros(n, np.uint8), np.ones(n, np.uint8)
            row0 = np.array([0], np.int64)
            assert copy_rows(d, s, row0, row0, n, 1 << 20, 3) == n
        t = threading.Thread(target=pinned_copy)
        t.start(); t.join()
        def comm(tid):  # a thread that ended since the listing (the joined one) has no comm any more
            try:
                return open(f"/proc/self/task/{tid}/comm").read().strip()
            except FileNotFoundError:
                return None
        def mask(tid):
            return [l for l in open(f"/proc/self/task/{tid}/status") if l.startswith("Cpus_allowed_list")][0].split()[1]
        import time
        for _ in range(50):  # (a CI run once listed one helper of two: listed again for 1 s, with every task shown)
            helpers = [tid for tid in set(os.listdir("/proc/self/task")) - before if comm(tid) == "kvtier-copy"]
            masks = [mask(tid) for tid in helpers]
            if len(masks) >= 2:
                break
            time.sleep(0.02)
        tasks = {tid: (comm(tid), tid in before) for tid in os.listdir("/proc/self/task")}
        assert len(masks) == 2 and masks[0] != masks[1], (masks, tasks)
        mine = os.sched_getscheduler(0)  # untouched; a helper leaves any policy but the normal one as it is
        want = os.SCHED_BATCH if mine == os.SCHED_OTHER else mine
        assert all(os.sched_getscheduler(int(tid)) == want for tid in helpers), (mine, want)
        print("policy", mine)
        print("ok")
    ''', prefix)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-800:]
    if "one cpu" not in r.stdout:
        assert f"policy {os.SCHED_IDLE if policy == 'idle' else os.SCHED_OTHER}" in r.stdout, r.stdout


@pytest.mark.parametrize("gap", [4096, -4096])
def test_overlapping_views_of_one_array_are_copied_as_memmove_would(gap):
    """1 MiB pairs take the streaming loop, which copies forwards: a destination
    overlapping the source from above would read bytes it had already overwritten."""
    r = _child(f'''
        from kvtier.tiers.hostcopy import HostCopier
        n, gap = 1 << 20, {gap}
        buf = np.random.default_rng(0).integers(0, 255, n + 8192, dtype=np.uint8)
        want = buf.copy()
        lo = 4096
        np.copyto(want[lo + gap: lo + gap + n], want[lo: lo + n])  # numpy handles the overlap
        HostCopier(1).copy([(buf[lo + gap: lo + gap + n], buf[lo: lo + n])])
        assert np.array_equal(buf, want)
        print("ok")
    ''')
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-800:]


def test_pairs_of_other_shapes_are_refused_before_any_byte_moves():
    import numpy as np

    from kvtier.tiers.hostcopy import HostCopier

    good_dst, good_src = np.zeros(1 << 20, np.uint8), np.ones(1 << 20, np.uint8)
    dst, src = np.zeros((2, 8), np.uint8), np.ones((4, 4), np.uint8)  # the same bytes, other shapes
    for compiled in (True, False):
        with pytest.raises(ValueError, match="shapes"):
            HostCopier(1, compiled=compiled).copy([(good_dst, good_src), (dst, src)])
        assert not dst.any() and not good_dst.any()


@pytest.mark.parametrize("name, value, emptied", [("I_N_BUCKETS", 2 ** 62, ("A_REUSES",)),
                                                  ("I_N_AGES", 2 ** 61, ("A_TABLES", "A_PROB"))])
def test_replay_registers_whose_products_would_wrap_are_refused(name, value, emptied):
    """A product of registers that wraps to 0 matches an empty array, so the size check
    passed and the loop indexed past it: such registers are refused first."""
    empty = "; ".join(f'g["arrays"][{_register(a)}] = g["arrays"][{_register(a)}][:0]' for a in emptied)
    r = _child(f'''
        g = captured()
        assert call({{**g, "ints": g["ints"].copy()}})  # the capture itself runs
        g["ints"][{_register(name)}] = {value}
        {empty}
        try:
            call(g)
        except ValueError as e:
            print("refused", e)
    ''')
    assert r.returncode == 0 and "refused run: registers out of range" in r.stdout, (r.stdout[-400:], r.stderr[-800:])


def test_replay_stages_times_irr_buckets_that_would_wrap_are_refused():
    """The cell count is checked against stages x IRR buckets, two registers nothing bounded:
    a product that wrapped to a small number passed, and a block's cell was written far out
    of bounds (a crash, or a division by zero where it wrapped to 0)."""
    r = _child(f'''
        g = captured()
        s = int(g["ints"][{_register("I_N_STAGES")}])
        k = next((2 ** 64 + r) // s for r in range(1, s + 1) if (2 ** 64 + r) % s == 0)  # s * k wraps to r
        assert k < 2 ** 63
        g["ints"][{_register("I_N_IRR")}] = k
        try:
            call(g)
        except ValueError as e:
            print("refused", e)
    ''')
    assert r.returncode == 0 and "refused run: registers out of range" in r.stdout, (r.stdout[-400:], r.stderr[-800:])


@pytest.mark.parametrize("inv_g", ["-1e15", "float('nan')"])
def test_a_negative_or_nan_granularity_reads_the_first_age_bucket(inv_g):
    r = _child(f'''
        g = captured()
        g["floats"][{_register("F_INV_G")}] = {inv_g}
        print("ran", call(g))
    ''')
    assert r.returncode == 0 and "ran" in r.stdout, r.stderr[-800:]
