"""Key files, callers and namespaces (no model): who a key names, and that no salt reaches another tenant."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skippy_cache.runtime import Keep
from skippy_cache.server.errors import APIError
from skippy_cache.server.limits import TenantRequests
from skippy_cache.server.tenants import (
    Caller,
    KeyFileError,
    Keys,
    Role,
    Scope,
    hash_key,
    in_tenant,
    parse_key_file,
)

ALICE, BOB, ROOT = "sk-alice-key", "sk-bob-key", "sk-root-key"


def key_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "keys.txt"
    path.write_text(text)
    return path


def test_a_key_file_names_tenants_roles_and_shared_namespaces(tmp_path: Path) -> None:
    path = key_file(tmp_path, f"""# the team's keys
{hash_key(ALICE)}  alice  user  shared=public,docs   # alice may join two shared namespaces

{hash_key(ROOT)} ops admin
""")
    keys = Keys(path, None)
    assert keys.tenants
    assert keys.authenticate(ALICE) == Caller("alice", Role.USER, frozenset({"public", "docs"}))
    assert keys.authenticate(ROOT) == Caller("ops", Role.ADMIN)
    assert keys.authenticate(BOB) is None
    assert keys.authenticate("") is None
    assert keys.shared == {"public", "docs"}


def test_the_single_api_key_is_an_admin_beside_the_file(tmp_path: Path) -> None:
    keys = Keys(key_file(tmp_path, f"{hash_key(ALICE)} alice user\n"), ROOT)
    assert keys.authenticate(ROOT) == Caller("admin", Role.ADMIN)
    # Without a key file there are no tenants: the one key sees the one cache, as before.
    alone = Keys(None, ROOT)
    assert not alone.tenants
    assert alone.authenticate(ROOT) == Caller(None, Role.ADMIN)


def test_a_plain_key_is_accepted_and_held_as_its_hash(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = Keys(key_file(tmp_path, f"{ALICE} alice user\n"), None)
    assert keys.authenticate(ALICE) == Caller("alice", Role.USER)
    assert "keys.txt:1 holds a plain key" in caplog.text
    assert ALICE not in caplog.text
    assert all(ALICE.encode() not in entry.digest for entry in keys._entries)


@pytest.mark.parametrize(("text", "message"), [
    ("k alice\n", "keys.txt:1: expected 'KEY TENANT ROLE [OPTION=VALUE ...]', got 2 fields"),
    ("# header\nk alice user public\n", "keys.txt:2: 'public' is not an option (shared=NAME,... or "
                                          "store=all|ram|none)"),
    ("k al/ice user\n", "keys.txt:1: tenant 'al/ice' is not a name"),
    ("k alice root\n", "keys.txt:1: role 'root' is neither 'user' nor 'admin'"),
    ("k alice user shared=public,\n", "keys.txt:1: shared namespace '' is not a name"),
    ("k alice user shared=a shared=b\n", "keys.txt:1: shared= given twice"),
    ("k alice user store=disk\n", "keys.txt:1: store='disk': expected all, ram or none"),
    ("k alice user store=none\nk2 alice admin\n", "keys.txt:2: store=all, but line 1 gives tenant 'alice' "
                                                   "store=none: a tenant's keys must agree"),
    ("sha256:abc alice user\n", "keys.txt:1: a hashed key is 'sha256:' and 64 lowercase hex digits"),
    (f"k alice user\n{hash_key('k')} bob user\n", "keys.txt:2: the same key as "),
    ("# nothing but comments\n\n", "no keys"),
])
def test_a_malformed_key_file_names_the_line(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(KeyFileError, match=None) as caught:
        Keys(key_file(tmp_path, text), None)
    assert message in str(caught.value)


def test_a_tenant_may_keep_its_entries_off_disk_or_out_of_every_tier(tmp_path: Path) -> None:
    keys = Keys(key_file(tmp_path, f"{hash_key(ALICE)} alice user store=ram shared=public\n"
                                   f"{hash_key(BOB)} bob user store=none\n"), None)
    assert keys.authenticate(ALICE) == Caller("alice", Role.USER, frozenset({"public"}), Keep.RAM)
    assert keys.authenticate(BOB) == Caller("bob", Role.USER, keep=Keep.NONE)


def test_a_missing_key_file_says_so(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="cannot read it"):
        Keys(tmp_path / "nope.txt", None)


def test_a_reload_swaps_every_key_or_none(tmp_path: Path) -> None:
    path = key_file(tmp_path, f"{hash_key(ALICE)} alice user\n{hash_key(BOB)} bob user\n")
    keys = Keys(path, None)
    path.write_text(f"{hash_key(BOB)} bob user\n")
    assert keys.reload() == 1
    assert keys.authenticate(ALICE) is None
    assert keys.authenticate(BOB) == Caller("bob", Role.USER)
    path.write_text("garbage\n")
    with pytest.raises(KeyFileError):
        keys.reload()
    assert keys.authenticate(BOB) == Caller("bob", Role.USER), "a bad file keeps the keys in use"


def test_namespaces_of_tenants_salts_and_shared_namespaces() -> None:
    assert Scope(None).namespace(None) is None
    assert Scope(None).namespace("s") == "s"  # no tenants: the salt, as before tenants existed
    alice = Scope("alice").namespace(None)
    assert alice is not None and in_tenant(alice, "alice") and not in_tenant(alice, "bob")
    assert in_tenant(Scope("alice").namespace("s"), "alice")
    assert not in_tenant(Scope("alicex").namespace(None), "alice")
    assert not in_tenant(Scope("alice", shared="public").namespace(None), "alice")
    assert Scope("alice", shared="public").namespace("s") == Scope("bob", shared="public").namespace("s")


names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,8}", fullmatch=True)
salts = st.none() | st.text(st.characters(blacklist_categories=("Cc",)), min_size=1, max_size=12)
scopes = st.builds(Scope, st.none() | names, st.none() | names)


@given(scopes, salts, scopes, salts)
def test_two_scopes_share_a_namespace_only_when_they_are_one(a: Scope, salt_a: str | None, b: Scope,
                                                            salt_b: str | None) -> None:
    # A tenant's namespace is no other tenant's, whatever salt either sends; the same shared
    # namespace is one whichever tenant joined it; and no salt spells a tenant's namespace.
    def where(scope: Scope) -> tuple[str, str | None]:
        if scope.shared is not None:
            return ("shared", scope.shared)
        return ("tenant", scope.tenant)

    same = where(a) == where(b) and salt_a == salt_b
    assert (a.namespace(salt_a) == b.namespace(salt_b)) == same


def test_a_tenant_past_its_requests_gets_a_429_and_others_do_not() -> None:
    limit = TenantRequests(2)
    limit.take("alice", 2)
    with pytest.raises(APIError) as caught:
        limit.take("alice", 1)
    assert caught.value.status == 429 and caught.value.headers == {"Retry-After": "1"}
    assert caught.value.code == "tenant_limit" and "--tenant-max-requests" in caught.value.message
    limit.take("bob", 2)
    limit.take(None, 100)  # no tenants: no limit
    limit.release("alice")
    limit.take("alice", 1)
    assert limit.held("alice") == 2


def test_hash_key_makes_a_key_file_line() -> None:
    out = subprocess.run([sys.executable, "-m", "skippy_cache", "hash-key", "--tenant", "alice", "--shared",
                          "public", "--store", "ram"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    key = out.stderr.strip().removeprefix("key: ")
    assert key.startswith("sk-skippy-") and len(key) > 40
    assert out.stdout.strip() == f"{hash_key(key)} alice user shared=public store=ram"
    assert parse_key_file(out.stdout, "x")[0].caller == Caller("alice", Role.USER, frozenset({"public"}), Keep.RAM)
    given_key = subprocess.run([sys.executable, "-m", "skippy_cache", "hash-key", "-", "--tenant", "ops",
                                "--role", "admin"], input="sk-root\n", capture_output=True, text=True, timeout=60)
    assert given_key.stdout.strip() == f"{hash_key('sk-root')} ops admin"
    assert parse_key_file(given_key.stdout, "x")[0].caller == Caller("ops", Role.ADMIN)


def test_a_malformed_key_file_stops_the_start_naming_the_line(tmp_path: Path) -> None:
    path = key_file(tmp_path, f"{hash_key(ALICE)} alice user\n{hash_key(BOB)} bob superuser\n")
    out = subprocess.run([sys.executable, "-m", "skippy_cache", "serve", "--api-keys", str(path), "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"skippy-cache serve: error: {path}:2: role 'superuser' is neither 'user' nor 'admin'" in out.stderr
    assert "loading model" not in out.stderr, "the key file is read before the model loads"
