"""Two users on one host, each with a daemon on default settings: neither can read, write or stop the other's.

Needs root (to create two throwaway users) and an interpreter the new users can
run; skips with the reason otherwise. Each user's daemon uses its default
per-user directories (no XDG variables: /tmp/kvtier-UID and ~/.local/share/kvtier).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

RUNUSER = shutil.which("runuser")
USERADD, USERDEL = shutil.which("useradd"), shutil.which("userdel")


def _as(user: str, code: str, timeout: float = 60, **popen) -> "subprocess.CompletedProcess[str]":
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": pwd.getpwnam(user).pw_dir}
    assert RUNUSER is not None
    return subprocess.run([RUNUSER, "-u", user, "--", sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=timeout, env=env, **popen)


@pytest.fixture
def users():
    if os.geteuid() != 0 or not (RUNUSER and USERADD and USERDEL):
        pytest.skip("needs root with useradd/runuser to create two users")
    base = Path(tempfile.mkdtemp(prefix="kvtier-users-"))  # homes the new users can reach
    os.chmod(base, 0o755)
    names = [f"kvt{uuid.uuid4().hex[:6]}{s}" for s in "ab"]
    for n in names:
        subprocess.run([USERADD, "-m", "-d", str(base / n), "-s", "/bin/sh", n], check=True, capture_output=True)
        os.chmod(base / n, 0o700)
    try:
        probe = _as(names[0], "import kvtier.daemon.server")
        if probe.returncode != 0:
            pytest.skip(f"a new user cannot run this interpreter and kvtier: {probe.stderr.strip()[-200:]}")
        yield names
    finally:
        for n in names:
            subprocess.run(["pkill", "-u", n], capture_output=True)
            time.sleep(0.2)
            uid = _uid(n)
            subprocess.run([USERDEL, "-r", n], capture_output=True)
            if uid is not None:
                shutil.rmtree(f"/tmp/kvtier-{uid}", ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def _uid(name: str):
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


def _start_daemon(user: str) -> subprocess.Popen:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": pwd.getpwnam(user).pw_dir}
    assert RUNUSER is not None
    p = subprocess.Popen([RUNUSER, "-u", user, "--", sys.executable, "-m", "kvtier.cli", "serve", "--log-level",
                          "WARNING", "--set", "metrics.port=0", "--set", "tiers.hbm_bytes=65536",
                          "--set", "tiers.dram_bytes=65536", "--set", "tiers.nvme_bytes=262144"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    info = Path(f"/tmp/kvtier-{pwd.getpwnam(user).pw_uid}/daemon.json")
    end = time.monotonic() + 30
    while not info.exists():
        if p.poll() is not None or time.monotonic() > end:
            out = p.stdout.read() if p.stdout else ""
            raise RuntimeError(f"{user}'s daemon did not start: {out}")
        time.sleep(0.05)
    return p


ENGINE = """
    import torch
    from kvtier.client.tier_client import TierClient
    c = TierClient(heartbeat_s=None)
    c.register(block_bytes=4096)
    blocks, slots = c.alloc(2, seq=1, pin=True)
    for s in slots.tolist():
        c.slot_view(s)[:] = torch.full((4096,), 0x5A, dtype=torch.uint8)  # the secret
    c.seal(blocks, [11, 12], seq=1)
    print("ok", flush=True)
"""


def test_two_users_cannot_reach_each_others_daemon(users):
    a, b = users
    uid_a = pwd.getpwnam(a).pw_uid
    da = _start_daemon(a)
    db = _start_daemon(b)
    try:
        r = _as(a, ENGINE)
        assert r.returncode == 0 and "ok" in r.stdout, r.stderr
        home_a = pwd.getpwnam(a).pw_dir
        attack = f"""
            import os, signal, glob
            from kvtier.client.tier_client import TierClient, KvtierError
            out = []
            try:
                TierClient(runtime_dir="/tmp/kvtier-{uid_a}", heartbeat_s=None, timeout_s=2).stats()
                out.append("connected")
            except (KvtierError, OSError) as e:
                out.append("refused:" + type(e).__name__)
            for path in ["/tmp/kvtier-{uid_a}/rpc.sock", "/tmp/kvtier-{uid_a}/admin.token",
                         "{home_a}/.local/share/kvtier/slab-0000.kvt"]:
                try:
                    open(path, "rb").read(1)
                    out.append("read:" + path)
                except OSError as e:
                    out.append("denied")
            try:
                os.kill({da.pid}, signal.SIGTERM)
                out.append("signalled")
            except OSError:
                out.append("denied")
            segs = [p for p in glob.glob("/dev/shm/kvtier_*") if os.stat(p).st_uid == {uid_a}]
            for p in segs:
                try:
                    open(p, "rb").read(1)
                    out.append("read-shm:" + p)
                except OSError:
                    out.append("denied")
            print(" ".join(out))
        """
        r = _as(b, attack)
        assert r.returncode == 0, r.stderr
        words = r.stdout.split()
        assert words[0].startswith("refused"), r.stdout
        assert all(w in ("denied",) for w in words[1:]), r.stdout
        assert da.poll() is None and db.poll() is None  # both still serving
        r = _as(a, "from kvtier.client.tier_client import TierClient; print(TierClient(heartbeat_s=None).ping()['pong'])")
        assert r.stdout.strip() == "True", r.stderr
    finally:
        for p in (da, db):
            p.send_signal(signal.SIGTERM)
            p.wait(30)


def test_a_runtime_dir_planted_by_another_user_is_refused(users):
    a, b = users
    uid_a = pwd.getpwnam(a).pw_uid
    planted = Path(f"/tmp/kvtier-{uid_a}")
    shutil.rmtree(planted, ignore_errors=True)
    r = _as(b, f"import os; os.mkdir('{planted}', 0o777); os.chmod('{planted}', 0o777)")
    assert r.returncode == 0, r.stderr
    with pytest.raises(RuntimeError, match="owned by"):
        _start_daemon(a)
    assert not any(planted.iterdir())  # a wrote nothing into b's directory
    shutil.rmtree(planted, ignore_errors=True)
