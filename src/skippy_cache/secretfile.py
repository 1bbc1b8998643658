"""The secret chunks are MAC'd with (chunks.py): read from the operator's file, or made in the cache directory.

    --cache-secret-file FILE   the operator's: replicas that share a tier must share it
    <cache-dir>/secret         made on first start (64 random hex digits, mode 0600), kept across restarts

A file is refused when anyone but its owner may read or write it, or when its
owner is neither this user nor root: whoever can read the secret can forge
chunks that verify, and whoever can write it can make the secret one they know.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from skippy_cache.chunks import ChunkError, derive_secret

CACHE_DIR_SECRET = "secret"
_OTHERS = 0o077


class SecretFileError(ValueError):
    """A secret file that cannot be read, is too short, or that others could read or write."""


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The MAC key made from the secret in `path` (its whole contents, surrounding whitespace stripped)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            material = f.read(1 << 16)
    except OSError as exc:
        raise SecretFileError(f"secret file {path}: cannot read it ({exc.strerror or exc})") from None
    if st.st_uid not in (os.geteuid(), 0):
        raise SecretFileError(
            f"secret file {path} belongs to another user (uid {st.st_uid}), who could change it to a "
            "secret they know: use a file of this user's or root's"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & _OTHERS:
        raise SecretFileError(
            f"secret file {path} is open to other users (mode {mode:04o}): whoever reads it can forge "
            f"cached state; chmod 600 {path}"
        )
    try:
        return derive_secret(material)
    except ChunkError as exc:
        raise SecretFileError(f"secret file {path}: {exc} (e.g. openssl rand -hex 32 > {path})") from None


def cache_dir_secret(root: str | os.PathLike[str]) -> bytes:
    """The MAC key of the secret kept in cache directory `root`, made there on first use.

    Made atomically (written to a private temporary file, then linked into
    place), so a crash never leaves a short secret and two processes racing
    to make it agree on the one that landed.
    """
    path = Path(root) / CACHE_DIR_SECRET
    if not os.path.lexists(path):
        tmp = path.with_name(f".{CACHE_DIR_SECRET}.{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process made it first: theirs is the secret
        finally:
            tmp.unlink(missing_ok=True)
    return read_secret_file(path)
