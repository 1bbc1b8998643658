"""DiskChunks on real files: atomic puts, restart, the directory lock, the budget, and failing disks."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from skippy_cache.chunks import chunk_key
from skippy_cache.diskchunks import CacheDirBusy, CacheDirUnsafe, DiskChunks, DiskChunkStats

SRC = Path(__file__).resolve().parents[2] / "src"


def K(i: int) -> str:
    return chunk_key(f"page-{i}", "layout")


def value(i: int, size: int = 100) -> bytes:
    return bytes([i % 256]) * size


def open_disk(root: Path, max_bytes: int = 10_000, reserve_bytes: int = 0) -> DiskChunks:
    return DiskChunks(root, max_bytes, reserve_bytes=reserve_bytes)


def chunk_files(root: Path) -> list[Path]:
    return sorted((root / "v1" / "chunks").rglob("*.chunk"))


def test_put_get_and_the_file_layout(tmp_path: Path) -> None:
    with open_disk(tmp_path) as d:
        assert d.put(K(1), value(1))
        assert d.get(K(1)) == value(1)
        assert d.get(K(2)) is None
        assert K(1) in d and K(2) not in d
        assert chunk_files(tmp_path) == [tmp_path / "v1" / "chunks" / K(1)[:2] / f"{K(1)}.chunk"]
        assert (tmp_path / "v1" / "quarantine").is_dir()
        assert (tmp_path / "lock").read_text().strip() == str(os.getpid())
        assert d.stats() == DiskChunkStats(
            chunks=1,
            bytes=100,
            max_bytes=10_000,
            found_at_start=0,
            removed_at_start=0,
            writes=1,
            write_failures=0,
            skipped_full=0,
            evictions=0,
            quarantined=0,
            root=str(tmp_path),
        )
        d.check_invariants()


def test_a_key_already_held_is_not_rewritten(tmp_path: Path) -> None:
    with open_disk(tmp_path) as d:
        assert d.put(K(1), value(1))
        assert d.put(K(1), value(2))
        assert d.get(K(1)) == value(1)
        assert d.stats().writes == 1


def test_put_refuses_a_name_that_is_not_a_key(tmp_path: Path) -> None:
    with open_disk(tmp_path) as d, pytest.raises(ValueError, match="not a chunk key"):
        d.put("../../etc/passwd", b"x")


def test_restart_finds_every_chunk_in_lru_order(tmp_path: Path) -> None:
    with open_disk(tmp_path) as d:
        for i in range(4):
            d.put(K(i), value(i, 50 + i))
        d.get(K(0))  # now the most recently used
        # mtime resolution can be coarse: spell the order out.
        for age, key in enumerate([K(1), K(2), K(3), K(0)]):
            os.utime(d._path(key), ns=(10**18 + age, 10**18 + age))
    with open_disk(tmp_path) as d:
        assert d.keys() == [K(1), K(2), K(3), K(0)]
        assert [d.get(K(i)) for i in range(4)] == [value(i, 50 + i) for i in range(4)]
        s = d.stats()
        assert (s.chunks, s.bytes, s.found_at_start, s.removed_at_start) == (4, 50 + 51 + 52 + 53, 4, 0)
        d.check_invariants()


def test_open_removes_temporary_and_foreign_files(tmp_path: Path) -> None:
    with open_disk(tmp_path) as d:
        d.put(K(1), value(1))
    sub = tmp_path / "v1" / "chunks" / K(1)[:2]
    (sub / f"{K(2)}.1a2b3c.tmp").write_bytes(b"half a write")  # a kill -9 mid-write
    (sub / "notes.txt").write_text("junk")
    elsewhere = next(K(i) for i in range(2, 10_000) if K(i)[:2] != sub.name)
    (sub / f"{elsewhere}.chunk").write_bytes(b"in the wrong fan-out directory")
    (sub / f"{K(1).upper()}.chunk").write_bytes(b"not a key")
    (tmp_path / "v1" / "chunks" / "stray").write_bytes(b"a file beside the fan-out")
    (tmp_path / "v1" / "chunks" / "not-ours").mkdir()
    with open_disk(tmp_path) as d:
        assert d.keys() == [K(1)]
        assert d.stats().removed_at_start == 5
        assert d.stats().found_at_start == 1
    assert sorted(p.name for p in sub.iterdir()) == [f"{K(1)}.chunk"]
    assert (tmp_path / "v1" / "chunks" / "not-ours").is_dir()  # a directory we did not make is left alone


# -- the lock --------------------------------------------------------------------------------


def test_a_second_open_in_the_same_process_is_refused(tmp_path: Path) -> None:
    with open_disk(tmp_path):
        with pytest.raises(CacheDirBusy) as e:
            open_disk(tmp_path)
        assert str(tmp_path) in str(e.value)
        assert f"pid {os.getpid()}" in str(e.value)
        assert "--cache-dir" in str(e.value)
    with open_disk(tmp_path):  # released by close()
        pass


def test_a_second_process_is_refused_while_the_first_holds_the_dir(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        from skippy_cache.diskchunks import CacheDirBusy, DiskChunks
        try:
            DiskChunks({str(tmp_path)!r}, 1000, reserve_bytes=0)
        except CacheDirBusy as e:
            print(e)
            sys.exit(3)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    with open_disk(tmp_path):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.returncode == 3, out.stderr
        assert str(tmp_path) in out.stdout and f"pid {os.getpid()}" in out.stdout
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_refused_open_leaves_the_holder_and_its_files_alone(tmp_path: Path) -> None:
    with open_disk(tmp_path) as d:
        d.put(K(1), value(1))
        tmp = d._path(K(1)).with_name(f"{K(2)}.abc.tmp")
        tmp.write_bytes(b"a write in progress")
        with pytest.raises(CacheDirBusy):
            open_disk(tmp_path)
        assert tmp.exists()  # the scan runs only under the lock
        assert (tmp_path / "lock").read_text().strip() == str(os.getpid())


# -- the budget ------------------------------------------------------------------------------


def test_eviction_takes_the_least_recently_used_first(tmp_path: Path) -> None:
    with open_disk(tmp_path, max_bytes=300) as d:
        for i in range(3):
            assert d.put(K(i), value(i))
        d.get(K(0))
        assert d.put(K(3), value(3))
        assert d.keys() == [K(2), K(0), K(3)]
        assert d.put(K(4), value(4, 200))
        assert d.keys() == [K(3), K(4)]
        assert not (d._path(K(1)).exists() or d._path(K(2)).exists() or d._path(K(0)).exists())
        assert d.stats().evictions == 3
        d.check_invariants()


def test_a_value_over_the_whole_budget_is_skipped(tmp_path: Path) -> None:
    with open_disk(tmp_path, max_bytes=300) as d:
        d.put(K(1), value(1))
        assert not d.put(K(2), value(2, 301))
        assert d.keys() == [K(1)]  # nothing evicted for it
        assert d.stats().skipped_full == 1
        assert chunk_files(tmp_path) == [d._path(K(1))]


def test_a_write_that_would_eat_the_reserve_is_skipped(tmp_path: Path) -> None:
    with open_disk(tmp_path, reserve_bytes=2**62) as d:
        assert not d.put(K(1), value(1))
        assert K(1) not in d
        assert d.stats().skipped_full == 1
        assert list((tmp_path / "v1" / "chunks").rglob("*")) == []


def test_an_unwritable_place_makes_put_return_false(tmp_path: Path) -> None:
    # A regular file where a fan-out directory belongs: every write under it
    # fails with an OSError, for root too (chmod would not stop root).
    with open_disk(tmp_path) as d:
        assert d.put(K(1), value(1))
        sub = d._path(K(1)).parent
        same_sub = next(i for i in range(2, 10_000) if K(i)[:2] == sub.name)
        other_sub = next(i for i in range(2, 10_000) if K(i)[:2] != sub.name)
        blocked = d._path(K(other_sub)).parent
        blocked.write_bytes(b"not a directory")
        held = sub.rename(tmp_path / "moved-away")
        sub.write_bytes(b"not a directory")
        try:
            assert not d.put(K(same_sub), value(2))  # cannot create the temporary file
            assert not d.put(K(other_sub), value(3))  # cannot create the fan-out directory
            assert d.stats().write_failures == 2
        finally:
            sub.unlink()
            held.rename(sub)
            blocked.unlink()
        assert d.get(K(1)) == value(1)
        assert d.keys() == [K(1)]
        assert [p.name for p in chunk_files(tmp_path)] == [f"{K(1)}.chunk"]
        d.check_invariants()


def test_a_failed_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    with open_disk(tmp_path) as d:
        monkeypatch.setattr(os, "fsync", no_space)
        assert not d.put(K(1), value(1))
        monkeypatch.undo()
        assert K(1) not in d and d.stats().write_failures == 1
        assert list((tmp_path / "v1" / "chunks").rglob("*.*")) == []


# -- removal ---------------------------------------------------------------------------------


def test_a_file_deleted_behind_our_back_is_a_miss(tmp_path: Path) -> None:
    with open_disk(tmp_path) as d:
        d.put(K(1), value(1))
        d._path(K(1)).unlink()
        assert d.get(K(1)) is None
        assert K(1) not in d and d.stats().bytes == 0
        d.check_invariants()


def test_quarantine_moves_the_file_aside(tmp_path: Path) -> None:
    with open_disk(tmp_path) as d:
        d.put(K(1), value(1))
        d.put(K(2), value(2))
        assert d.quarantine(K(1))
        assert not d.quarantine(K(1))
        assert K(1) not in d and d.stats().quarantined == 1 and d.stats().bytes == 100
        moved = list((tmp_path / "v1" / "quarantine").iterdir())
        assert len(moved) == 1 and moved[0].name.startswith(K(1)) and moved[0].read_bytes() == value(1)
        assert not d._path(K(1)).exists()
        d.put(K(1), value(1))
        d.quarantine(K(1))  # a second quarantine of the same key gets its own name
        assert len(list((tmp_path / "v1" / "quarantine").iterdir())) == 2
    with open_disk(tmp_path) as d:
        assert d.keys() == [K(2)]  # quarantined files are not indexed again


def test_discard_and_clear(tmp_path: Path) -> None:
    with open_disk(tmp_path) as d:
        for i in range(3):
            d.put(K(i), value(i))
        assert d.discard(K(0)) and not d.discard(K(0))
        assert d.clear() == 2
        assert len(d) == 0 and d.stats().bytes == 0 and chunk_files(tmp_path) == []
        d.check_invariants()


# -- privacy at rest: chunks are prompt-derived --------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_what_the_disk_tier_creates_is_private_whatever_the_umask(
    tmp_path: Path, permissive_umask: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "home" / ".cache" / "store"  # parents missing too, as `~/.cache` may be
    temporary_modes: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # the temporary file, before its rename, is already private
        temporary_modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        real_fsync(fd)

    with open_disk(root) as d:
        monkeypatch.setattr(os, "fsync", fsync)
        assert d.put(K(1), value(1)) and d.put(K(2), value(2))
        monkeypatch.undo()
        assert d.quarantine(K(2))
    assert temporary_modes == [0o600, 0o600]
    dirs = [tmp_path / "home", tmp_path / "home" / ".cache", root, root / "v1", root / "v1" / "chunks",
            root / "v1" / "quarantine", d._path(K(1)).parent]
    assert {str(p): mode(p) for p in dirs} == {str(p): 0o700 for p in dirs}
    files = [root / "lock", d._path(K(1)), *(root / "v1" / "quarantine").iterdir()]
    assert len(files) == 3
    assert {str(p): mode(p) for p in files} == {str(p): 0o600 for p in files}


def test_a_root_another_user_owns_is_refused_whatever_its_mode(tmp_path: Path) -> None:
    # As root (CI) the test hands a directory to another user; as anyone else, "/" is root's.
    if os.geteuid() == 0:
        root = tmp_path / "theirs"
        root.mkdir(mode=0o700)
        os.chown(root, 65534, 65534)
    else:
        root = Path("/")
    with pytest.raises(CacheDirUnsafe) as e:
        open_disk(root)
    assert f"cache directory {root} belongs to another user (uid {root.stat().st_uid}" in str(e.value)
    if os.geteuid() == 0:
        assert list(root.iterdir()) == []


@pytest.mark.parametrize("root_mode", [0o770, 0o702, 0o1777], ids=["group", "world", "sticky-like-tmp"])
def test_a_root_other_users_can_write_is_refused_naming_the_fix(tmp_path: Path, root_mode: int) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(root_mode)
    with pytest.raises(CacheDirUnsafe) as e:
        open_disk(root)
    message = str(e.value)
    assert f"cache directory {root} is writable by other users (mode {root_mode:04o})" in message
    assert f"chmod 700 {root}" in message and "--cache-dir" in message
    assert isinstance(e.value, ValueError)
    assert list(root.iterdir()) == []  # refused before the lock file or the tree is made
    assert mode(root) == root_mode  # the operator's directory is not changed for them


def test_a_root_others_may_only_read_is_used_and_left_as_it_is(tmp_path: Path, permissive_umask: None) -> None:
    root = tmp_path / "readable"
    root.mkdir()
    root.chmod(0o755)
    with open_disk(root) as d:
        assert d.put(K(1), value(1))
    assert mode(root) == 0o755
    assert mode(root / "v1") == 0o700 and mode(d._path(K(1))) == 0o600


def test_an_older_versions_0644_chunks_and_0755_dirs_are_tightened_at_open(tmp_path: Path) -> None:
    with open_disk(tmp_path) as d:
        d.put(K(1), value(1))
        d.put(K(2), value(2))
        d.quarantine(K(2))
    # What the version before this rule left: default modes under umask 022.
    wide_dirs = [tmp_path / "v1", tmp_path / "v1" / "chunks", tmp_path / "v1" / "quarantine",
                 d._path(K(1)).parent]
    wide_files = [tmp_path / "lock", d._path(K(1)), *(tmp_path / "v1" / "quarantine").iterdir()]
    for p in wide_dirs:
        p.chmod(0o755)
    for p in wide_files:
        p.chmod(0o644)
    with open_disk(tmp_path) as d:
        assert d.keys() == [K(1)] and d.get(K(1)) == value(1)
        assert d.stats().found_at_start == 1
    assert {str(p): mode(p) for p in wide_dirs} == {str(p): 0o700 for p in wide_dirs}
    assert {str(p): mode(p) for p in wide_files} == {str(p): 0o600 for p in wide_files}
