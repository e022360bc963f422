"""Kernels that must not hang or read freed memory when the process's limits or the caller's
objects misbehave (each in a child process: a failure here is a hang or a crash)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def test_an_io_batch_whose_items_change_their_list_reads_no_freed_memory(tmp_path):
    """The compiled loop took the caller's lists as they were (PySequence_Fast) and parsing an
    item can run Python (an ``__index__``): one that emptied the list left the loop reading
    freed memory. It works on its own copy now."""
    code = textwrap.dedent(f'''
        import os
        import numpy as np
        import kvtier.kernels._blockio as bio
        fd = os.open({str(tmp_path / "f")!r}, os.O_RDWR | os.O_CREAT, 0o600)
        os.pwrite(fd, b"x" * 4096, 0)
        class Shrinks:
            def __index__(self):
                fds.clear()
                for _ in range(50):
                    [object() for _ in range(1000)]
                return fd
        fds = [Shrinks()] + [fd] * 1999
        out = bio.transfer(False, fds, [0] * 2000, [[np.zeros(16, np.uint8)] for _ in range(2000)], None)
        print("ok", len(out))
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok 2000" in r.stdout, (r.returncode, r.stdout[-300:], r.stderr[-800:])


def test_a_started_copy_that_no_helper_can_take_is_copied_before_start_returns():
    """Where no helper thread can start (a thread or memory limit), nobody copied the job before
    join(), and the owner joins a started copy only once done() says it landed: it never did.
    Helper creation is made to fail with RLIMIT_AS (root ignores RLIMIT_NPROC)."""
    code = textwrap.dedent('''
        import re, resource
        import numpy as np
        from kvtier.kernels import _copy
        src = np.full((64, 4096), 5, np.uint8); dst = np.zeros_like(src); rows = np.arange(64, dtype=np.int64)
        vm = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 17), resource.RLIM_INFINITY))  # < a helper's stack
        job = _copy.start_rows(dst, src, rows, rows, 4096, 1 << 20, 2)
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print("done", job.done(), bool((dst == 5).all()), job.join())
    ''')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and "MemoryError" in r.stderr:
        pytest.skip("the address-space limit failed more than the helper's start here")
    assert r.returncode == 0 and "done True True 262144" in r.stdout, r.stdout + r.stderr
