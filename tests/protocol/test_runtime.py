"""Runtime and data directories: XDG defaults and the private-directory check (real dirs)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvtier.protocol.runtime import (
    UnsafeDirError,
    default_data_dir,
    default_runtime_dir,
    ensure_private_dir,
    write_private_file,
)


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_missing_dir_is_created_private_with_its_parents(tmp_path: Path) -> None:
    d = tmp_path / "a" / "b" / "kvtier"
    old = os.umask(0)  # a permissive umask must not widen the directory
    try:
        assert ensure_private_dir(d) == d
    finally:
        os.umask(old)
    assert d.is_dir() and _mode(d) == 0o700


def test_symlinked_dir_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "kvtier"
    link.symlink_to(target)
    with pytest.raises(UnsafeDirError) as ei:
        ensure_private_dir(link)
    assert str(link) in str(ei.value) and "symlink" in str(ei.value)


def test_a_file_in_its_place_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "kvtier"
    f.write_text("planted")
    with pytest.raises(UnsafeDirError) as ei:
        ensure_private_dir(f)
    assert str(f) in str(ei.value) and "not a directory" in str(ei.value)


def test_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    d = tmp_path / "kvtier"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(UnsafeDirError) as ei:
        ensure_private_dir(d)
    msg = str(ei.value)
    assert str(d) in msg and "65534" in msg
    assert os.lstat(d).st_uid == 65534 and _mode(d) == 0o700  # refused, not taken over


def test_group_writable_dir_of_ours_is_made_private(tmp_path: Path) -> None:
    d = tmp_path / "kvtier"
    d.mkdir()
    os.chmod(d, 0o775)
    assert ensure_private_dir(d) == d
    assert _mode(d) == 0o700


def test_private_dir_is_left_as_it_is(tmp_path: Path) -> None:
    d = tmp_path / "kvtier"
    d.mkdir(mode=0o700)
    (d / "slab-0000.kvt").write_bytes(b"x")
    assert ensure_private_dir(str(d)) == d
    assert (d / "slab-0000.kvt").read_bytes() == b"x"


def test_defaults_without_xdg_follow_the_standard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Path(default_data_dir()) == tmp_path / ".local" / "share" / "kvtier"
    assert Path(default_runtime_dir()) == Path("/tmp") / f"kvtier-{os.getuid()}"


def test_defaults_with_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert Path(default_data_dir()) == tmp_path / "data" / "kvtier"
    assert Path(default_runtime_dir()) == tmp_path / "kvtier"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/data")  # the spec says: ignore a relative path
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Path(default_data_dir()) == tmp_path / ".local" / "share" / "kvtier"


def test_private_file_is_written_new_and_never_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    d = ensure_private_dir(tmp_path / "run")
    (d / f"daemon.json.{os.getpid()}.tmp").symlink_to(victim)  # planted where the temp file goes
    (d / "daemon.json").symlink_to(victim)  # ... and in place of the file itself
    write_private_file(d / "daemon.json", b'{"pid": 1}')
    assert victim.read_text() == "keep"
    info = d / "daemon.json"
    assert not info.is_symlink() and info.read_bytes() == b'{"pid": 1}' and _mode(info) == 0o600
    assert sorted(x.name for x in d.iterdir()) == ["daemon.json"]


def test_one_variable_points_every_process_at_one_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.daemon.config import ConfigError, load_config

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("KVTIER_RUNTIME_DIR", str(tmp_path / "shared"))
    assert default_runtime_dir() == str(tmp_path / "shared")  # clients, the CLI and the vLLM connector
    assert load_config().server.runtime_dir == str(tmp_path / "shared")  # the daemon's default
    # a config resolved without the environment (validate, replay) takes no default from it either
    assert load_config(environ={}).server.runtime_dir == f"/tmp/kvtier-{os.getuid()}"
    assert load_config(environ={"XDG_RUNTIME_DIR": str(tmp_path)}).server.runtime_dir == str(tmp_path / "kvtier")
    monkeypatch.setenv("KVTIER_RUNTIME_DIR", "relative/kvtier")
    with pytest.raises(UnsafeDirError, match="KVTIER_RUNTIME_DIR must be an absolute path"):
        default_runtime_dir()
    with pytest.raises(ConfigError, match="KVTIER_RUNTIME_DIR must be an absolute path"):
        load_config()  # a config error (a reload rejects it), not an OSError from a default
    assert load_config(environ={}).server.runtime_dir == f"/tmp/kvtier-{os.getuid()}"  # config validate, replay


def test_a_file_where_a_parent_should_be_is_named(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError) as ei:
        ensure_private_dir(tmp_path / "afile" / "sub" / "kvtier")
    assert f"{tmp_path / 'afile'} is in the way" in str(ei.value)
