"""The chunk MAC secret: made once in a cache directory, read from an operator's file, refused when others can reach it."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from skippy_cache.chunks import derive_secret
from skippy_cache.secretfile import CACHE_DIR_SECRET, SecretFileError, cache_dir_secret, read_secret_file


def test_a_cache_dir_secret_is_made_once_private_and_kept(tmp_path: Path) -> None:
    first = cache_dir_secret(tmp_path)
    path = tmp_path / CACHE_DIR_SECRET
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert len(text.strip()) == 64 and int(text, 16) >= 0
    assert first == derive_secret(text.encode())
    assert cache_dir_secret(tmp_path) == first  # a restart reads the same secret back
    assert sorted(p.name for p in tmp_path.iterdir()) == [CACHE_DIR_SECRET]  # no temporary file left
    other = tmp_path / "other"
    other.mkdir()
    assert cache_dir_secret(other) != first


def test_processes_racing_to_make_it_agree(tmp_path: Path) -> None:
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda: got.append(cache_dir_secret(tmp_path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1


def test_an_operator_file_is_read_whole_and_stripped(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("  correct horse battery staple, and then some  \n")
    path.chmod(0o600)
    assert read_secret_file(path) == derive_secret(b"correct horse battery staple, and then some")
    path.chmod(0o400)  # read-only is fine too
    assert read_secret_file(path) == derive_secret(b"correct horse battery staple, and then some")


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o666])
def test_a_file_others_can_read_or_write_is_refused_naming_the_fix(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "secret"
    path.write_text("x" * 64)
    path.chmod(mode)
    with pytest.raises(SecretFileError) as e:
        read_secret_file(path)
    assert f"mode {mode:04o}" in str(e.value) and f"chmod 600 {path}" in str(e.value)


def test_a_cache_dir_secret_widened_since_is_refused(tmp_path: Path) -> None:
    cache_dir_secret(tmp_path)
    (tmp_path / CACHE_DIR_SECRET).chmod(0o644)
    with pytest.raises(SecretFileError, match="open to other users"):
        cache_dir_secret(tmp_path)


def test_a_short_or_missing_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("hunter2\n")
    path.chmod(0o600)
    with pytest.raises(SecretFileError, match="at least 32 bytes, got 7.*openssl rand -hex 32"):
        read_secret_file(path)
    with pytest.raises(SecretFileError, match="cannot read it"):
        read_secret_file(tmp_path / "missing")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can hand a file to another user")
def test_a_file_another_user_owns_is_refused(tmp_path: Path) -> None:
    # CI runs as root; a file of root's is accepted (a mounted secret), one of another user's not.
    path = tmp_path / "secret"
    path.write_text("x" * 64)
    path.chmod(0o600)
    assert read_secret_file(path)
    os.chown(path, 65534, 65534)
    with pytest.raises(SecretFileError, match="belongs to another user \\(uid 65534\\)"):
        read_secret_file(path)
