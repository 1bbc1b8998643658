"""The disk tier: sealed chunks as files under one cache directory, under a byte budget.

    root/lock                         held (flock) by the one process using the directory
    root/v1/chunks/<2 hex>/<key>.chunk
    root/v1/quarantine/               files that failed verification, kept for a post-mortem

Bytes only: values are whatever `chunks.seal` made, and the caller verifies
every read (`chunks.unseal`), so this class never reads contents at start and
trusts only file names. A write is atomic (temporary file, fsync, rename), so
a crash leaves either the whole file or a `*.tmp`, which the next open removes.
A failed write (disk full, read-only, permissions) is a skipped cache entry,
never an error for the request that made it.

Chunks are prompt-derived (KV state can be inverted back to text), so nothing
here is readable by other local users: every directory this class creates is
0700 and every file 0600, whatever the umask; files and our own directories
left wider by an older version are tightened at open; and a root that others
can write is refused (`CacheDirUnsafe`), since they could read, plant or swap
chunks there. A root that others may only read is used as it is: what lies
inside is ours and private.

Invariants, checked by `check_invariants` and the tests:
- booked bytes equal the sum of the indexed files' sizes and never exceed `max_bytes`;
- eviction follows the policy's books (eviction.py); at open, files are booked oldest mtime first,
  so the policy starts from the order of their last use;
- one process per directory: a second open, in this process or another, raises `CacheDirBusy`.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from skippy_cache.chunks import is_key
from skippy_cache.eviction import Policy, make_books

GIB = 1 << 30

_VERSION_DIR = "v1"  # bump with an incompatible layout; an old tree is then left alone, not misread
_SUFFIX = ".chunk"
_TMP_SUFFIX = ".tmp"
_HEX = set("0123456789abcdef")
#: Modes of what we create; given at creation (the umask can only take bits away), so no
#: window exists in which a chunk is readable by others.
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_OTHERS = 0o077  # group and world bits: any of them set is tightened
_OTHERS_WRITE = 0o022


class CacheDirBusy(RuntimeError):
    """Another DiskChunks (this process or another) holds the cache directory."""


class CacheDirUnsafe(ValueError):
    """The cache directory is writable by other users, who could read, plant or swap chunks there."""


@dataclass(frozen=True, slots=True)
class DiskChunkStats:
    chunks: int
    bytes: int
    max_bytes: int
    #: Chunk files indexed when the directory was opened.
    found_at_start: int
    #: Temporary files (a write cut by a crash) and foreign names removed at open.
    removed_at_start: int
    writes: int
    #: Writes that hit an OSError (ENOSPC, EROFS, EACCES...): the chunk is not stored.
    write_failures: int
    #: Values larger than the whole budget, or that would eat into the filesystem's reserve.
    skipped_full: int
    evictions: int
    quarantined: int
    root: str
    #: LRFU: the turnovers the disk tier keeps a chunk used twice longer, as lately chosen; None under LRU.
    eviction_bonus: float | None = None


class DiskChunks:
    """Sealed chunk values as files, least recently used evicted first; one owner process per directory."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        max_bytes: int,
        *,
        reserve_bytes: int = GIB,
        policy: Policy | str = Policy.LRU,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
        self._init_books(max_bytes, policy, clock)
        self.root = Path(root)
        self.reserve_bytes = reserve_bytes
        self._chunks_dir = self.root / _VERSION_DIR / "chunks"
        self._quarantine_dir = self.root / _VERSION_DIR / "quarantine"
        make_private_dirs(self.root)
        _refuse_if_others_can_write(self.root)
        # Locked before the scan: the scan deletes *.tmp files, which a live owner may be writing.
        self._lock: IO[bytes] | None = _lock(self.root)
        try:
            make_private_dirs(self._chunks_dir)
            make_private_dirs(self._quarantine_dir)
            for ours in (self.root / _VERSION_DIR, self._chunks_dir, self._quarantine_dir):
                _tighten(ours, PRIVATE_DIR_MODE)
            self._scan()
        except BaseException:
            self.close()
            raise

    def _init_books(self, max_bytes: int, policy: Policy | str, clock: Callable[[], float]) -> None:
        """The books and counters, apart from the directory (a replay keeps only these: sizing.replay)."""
        if max_bytes <= 0:
            raise ValueError(f"a disk tier needs a positive byte budget, got {max_bytes}")
        self.max_bytes = max_bytes
        self._index = make_books(policy, clock)  # key -> file size, in eviction order
        self._found_at_start = 0
        self._removed_at_start = 0
        self._writes = 0
        self._write_failures = 0
        self._skipped_full = 0
        self._evictions = 0
        self._quarantined = 0

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the directory (idempotent); the books stay readable, the files stay on disk."""
        if self._lock is not None:
            lock, self._lock = self._lock, None
            lock.close()  # closing the only descriptor of the open file releases the flock

    def __enter__(self) -> DiskChunks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _scan(self) -> None:
        found: list[tuple[int, str, int]] = []  # (mtime_ns, key, size)
        for sub in self._chunks_dir.iterdir():
            if not sub.is_dir():
                self._remove_at_start(sub)
                continue
            if len(sub.name) != 2 or not set(sub.name) <= _HEX:
                continue  # not a directory we make: left alone rather than deleted
            _tighten(sub, PRIVATE_DIR_MODE)  # an older version made it 0755: others could list the keys
            for path in sub.iterdir():
                key = path.name.removesuffix(_SUFFIX)
                if path.name.endswith(_SUFFIX) and is_key(key) and key[:2] == sub.name and path.is_file():
                    try:
                        st = path.stat()
                    except OSError:
                        continue  # vanished under us
                    _tighten(path, PRIVATE_FILE_MODE, st.st_mode)
                    found.append((st.st_mtime_ns, key, st.st_size))
                else:
                    self._remove_at_start(path)
        # Quarantined files are chunks too: an older version's stay 0644 until tightened here.
        for path in self._quarantine_dir.iterdir():
            _tighten(path, PRIVATE_FILE_MODE)
        found.sort()
        for _, key, size in found:
            self._index.add(key, size)
        self._found_at_start = len(found)

    def _remove_at_start(self, path: Path) -> None:
        """Remove a temporary file or a foreign file name from our chunk tree."""
        if path.is_dir():
            return
        try:
            path.unlink()
        except OSError:
            return
        self._removed_at_start += 1

    # -- reads -----------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def keys(self) -> list[str]:
        """Every key held (least recently used first under LRU)."""
        return self._index.keys()

    def get(self, key: str) -> bytes | None:
        """The raw value (unverified: the caller unseals it), now the most recently used; None if absent."""
        if key not in self._index:
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                value = f.read()
        except OSError:
            self._forget(key)  # deleted behind our back, or unreadable: a miss from now on
            return None
        self._index.touch(key)
        try:
            os.utime(path)  # so that the LRU order survives a restart (it is rebuilt from mtimes)
        except OSError:
            pass
        return value

    # -- writes ----------------------------------------------------------------------------------

    def put(self, key: str, value: bytes, *, parent: str | None = None, tail: bool = False) -> bool:
        """Store a value atomically, evicting files to fit; False if not stored. `parent` and `tail`:
        the eviction policy's hints (eviction.py).

        Never raises for the filesystem's sake: a full or read-only disk is a skipped entry.
        A key already held is not rewritten (keys name contents) and counts as stored.
        """
        if key in self._index:
            return True
        return self.write_file(key, value) and self.book(key, len(value), parent=parent, tail=tail)

    def write_file(self, key: str, value: bytes) -> bool:
        """The file half of `put`: write it atomically (temporary file, fsync, rename), books untouched.

        Touches no shared state, so a writer thread may call it without the lock
        that guards the books, and a slow disk delays only that thread; `book`
        then makes the file count. False (nothing left behind) when the value is
        larger than the budget, would eat into the filesystem's reserve, or the
        write fails.
        """
        if not is_key(key):
            raise ValueError(f"{key!r} is not a chunk key (32 lowercase hex digits)")
        size = len(value)
        if size > self.max_bytes or not self._room_on_filesystem(size):
            self._skipped_full += 1
            return False
        final = self._path(key)
        tmp = final.with_name(f"{key}.{os.urandom(6).hex()}{_TMP_SUFFIX}")
        try:
            make_private_dirs(final.parent)
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE), "wb") as f:
                f.write(value)
                f.flush()
                os.fsync(f.fileno())
            # No fsync of the directory: a rename lost to a power cut loses a cache entry, nothing more.
            os.replace(tmp, final)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self._write_failures += 1
            return False
        return True

    def book(self, key: str, size: int, *, parent: str | None = None, tail: bool = False) -> bool:
        """Count a file `write_file` wrote, evicting others in the policy's order to stay in budget."""
        if key in self._index:
            return True
        while len(self._index) and self._index.bytes + size > self.max_bytes:
            victim, _ = self._index.evict()
            self._delete(victim)
            self._evictions += 1
        self._index.add(key, size, parent=parent, tail=tail)
        self._writes += 1
        return True

    def touch(self, key: str) -> None:
        """A use of a held chunk that read nothing (another entry produced it again)."""
        self._index.touch(key)

    def unwrite(self, key: str) -> None:
        """Delete a file `write_file` wrote that will not be booked (its entry went meanwhile): left
        in place, the next start's scan would serve it again. A booked key is left alone."""
        if key in self._index:
            return
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError:
            pass

    def _room_on_filesystem(self, size: int) -> bool:
        """Whether writing `size` bytes leaves at least `reserve_bytes` free for everything else."""
        try:
            st = os.statvfs(self._chunks_dir)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize - size >= self.reserve_bytes

    def discard(self, key: str) -> bool:
        """Delete a chunk; False if it was not held."""
        if key not in self._index:
            return False
        self._unlink(key)
        return True

    def quarantine(self, key: str) -> bool:
        """Move a chunk that failed verification out of the tree, under a unique name; False if not held."""
        if key not in self._index:
            return False
        path = self._path(key)
        self._forget(key)
        self._quarantined += 1
        try:
            os.replace(path, self._quarantine_dir / f"{key}.{os.urandom(6).hex()}{_SUFFIX}")
        except OSError:
            try:
                path.unlink(missing_ok=True)  # cannot keep it for inspection: at least never read it again
            except OSError:
                pass
        return True

    def clear(self) -> int:
        """Delete every chunk; returns how many were held."""
        n = len(self._index)
        for key in self._index.keys():
            self._unlink(key)
        return n

    def _unlink(self, key: str) -> None:
        self._forget(key)
        self._delete(key)

    def _delete(self, key: str) -> None:
        """Delete a file the books no longer hold."""
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError:
            pass  # a read-only disk: the file stays, but the index no longer counts or serves it

    def _forget(self, key: str) -> None:
        self._index.remove(key)

    def _path(self, key: str) -> Path:
        return self._chunks_dir / key[:2] / f"{key}{_SUFFIX}"

    # -- books -----------------------------------------------------------------------------------

    def stats(self) -> DiskChunkStats:
        return DiskChunkStats(
            chunks=len(self._index),
            bytes=self._index.bytes,
            max_bytes=self.max_bytes,
            found_at_start=self._found_at_start,
            removed_at_start=self._removed_at_start,
            writes=self._writes,
            write_failures=self._write_failures,
            skipped_full=self._skipped_full,
            evictions=self._evictions,
            quarantined=self._quarantined,
            root=str(self.root),
            eviction_bonus=self._index.bonus,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the books contradict themselves (tests and debug)."""
        self._index.check_invariants()
        assert self._index.bytes <= self.max_bytes, f"{self._index.bytes} bytes over the budget {self.max_bytes}"


def make_private_dirs(path: Path) -> None:
    """Create `path` and every missing parent with mode 0700; an existing directory keeps its mode.

    Not `Path.mkdir(parents=True, mode=...)`: that gives the parents the default mode (0755 under the
    usual umask), and a parent we create, such as `~/.cache`, is as much ours as the leaf.
    """
    missing: list[Path] = []
    while not path.is_dir() and path.parent != path:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, PRIVATE_DIR_MODE)
        except FileExistsError:
            if not directory.is_dir():
                raise  # a file where the directory belongs


def _refuse_if_others_can_write(root: Path) -> None:
    st = os.stat(root)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        # Its owner can write it whatever the mode says (chmod is theirs), and plant chunks.
        raise CacheDirUnsafe(
            f"cache directory {root} belongs to another user (uid {st.st_uid}; this server runs as uid "
            f"{os.geteuid()}), who can write it and swap the chunks kept there: pass a --cache-dir of "
            "this user's (a path that does not exist yet is created with mode 0700)"
        )
    if mode & _OTHERS_WRITE:
        # Not tightened for the operator: the directory may be shared on purpose (/tmp is), and a
        # chmod there would break others; not used either, as whoever can write it can swap chunks.
        raise CacheDirUnsafe(
            f"cache directory {root} is writable by other users (mode {mode:04o}), and the chunks kept "
            f"there are derived from prompts: chmod 700 {root} if the directory is the cache's alone, "
            "or pass another --cache-dir (a path that does not exist yet is created with mode 0700)"
        )


def _tighten(path: Path, mode: int, st_mode: int | None = None) -> None:
    """Set `path` to `mode` if group or world has any bit on it; left as it is if that fails (a read-only disk)."""
    try:
        current = stat.S_IMODE(os.stat(path).st_mode if st_mode is None else st_mode)
        if current & _OTHERS:
            os.chmod(path, mode)
    except OSError:
        pass


def _lock(root: Path) -> IO[bytes]:
    """Take `root/lock` exclusively, or raise CacheDirBusy naming the holder's pid.

    flock, not fcntl's POSIX locks: a flock belongs to the open file description,
    so a second open() of the lock file conflicts even within this process,
    and the lock goes away with the process however it dies.
    """
    fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
    lock = os.fdopen(fd, "r+b", buffering=0)  # held open until close()
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(lock)
        lock.close()
        who = "" if holder is None else f" (pid {holder}{', this process' if holder == os.getpid() else ''})"
        raise CacheDirBusy(
            f"cache directory {root} is in use by another skippy-cache{who}: "
            "use another --cache-dir, or stop the process holding it"
        ) from None
    except BaseException:
        lock.close()
        raise
    _tighten(root / "lock", PRIVATE_FILE_MODE)  # an older version made it 0644; it holds only a pid
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n".encode())
    return lock


def _read_pid(lock: IO[bytes]) -> int | None:
    try:
        text = os.pread(lock.fileno(), 32, 0).decode("ascii").strip()
        return int(text)
    except (OSError, ValueError):
        return None
