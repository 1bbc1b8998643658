"""Chunk keys and sealed values: round trips, and every way a value is refused."""

from __future__ import annotations

import struct

import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_cache.chunks import (
    MAGIC,
    MIN_SECRET_MATERIAL,
    Chunk,
    ChunkError,
    chunk_key,
    derive_secret,
    is_key,
    seal,
    tail_key,
    unseal,
)

PAGE = "stage0:0:64:0:0123456789abcdef"
LAYOUT = "f7bfaaf7df25880c76c7941bcfba22d6"
KEY = chunk_key(PAGE, LAYOUT)
SECRET = derive_secret(b"a test secret, not a secret at all: 0123456789")


def chunk(payload: bytes = bytes(range(200)), logits: bytes | None = None, tokens: int = 4) -> Chunk:
    return Chunk(KEY, tokens, payload, logits)


# -- keys ------------------------------------------------------------------------------------


def test_keys_are_32_lowercase_hex_and_stable() -> None:
    # Regression pin: a changed value means every stored chunk stops matching.
    assert KEY == chunk_key(PAGE, LAYOUT)
    assert is_key(KEY) and is_key(tail_key(PAGE, LAYOUT))
    assert len(KEY) == 32 and KEY == KEY.lower()
    assert chunk_key("p", "l") == "6a409a216fe5d4e8af80b442eb9f94d7"


def test_keys_differ_by_kind_layout_and_page() -> None:
    keys = {
        chunk_key(PAGE, LAYOUT),
        tail_key(PAGE, LAYOUT),
        chunk_key(PAGE, "0" * 32),
        chunk_key(PAGE.replace(":64:", ":65:"), LAYOUT),
        tail_key(PAGE, "0" * 32),
    }
    assert len(keys) == 5


def test_key_fields_are_framed() -> None:
    # Moving a character from the page id to the layout must change the key.
    assert chunk_key("ab", "c") != chunk_key("a", "bc")


def test_is_key_refuses_other_shapes() -> None:
    assert not is_key(KEY.upper())
    assert not is_key(KEY[:-1])
    assert not is_key(KEY + "0")
    assert not is_key("../" + KEY[3:])
    assert not is_key(KEY[:-1] + "g")


# -- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize("logits", [None, struct.pack("<3f", 0.5, -1.0, 2.0)])
def test_seal_unseal_round_trip(logits: bytes | None) -> None:
    c = chunk(logits=logits)
    value = seal(c, SECRET)
    assert value.startswith(MAGIC)
    assert unseal(KEY, value, SECRET) == c
    assert unseal(KEY, bytearray(value), SECRET) == c
    assert unseal(KEY, memoryview(value), SECRET) == c


def test_unseal_views_an_immutable_value_and_copies_a_mutable_one() -> None:
    c = chunk()
    value = seal(c, SECRET)
    viewed = unseal(KEY, value, SECRET)
    assert isinstance(viewed.payload, memoryview) and viewed.payload.obj is value  # no copy of the rows
    mutable = bytearray(value)
    copied = unseal(KEY, mutable, SECRET)
    mutable[-1] ^= 0xFF  # a buffer the caller may change: the chunk must not change with it
    assert copied == c


def test_nbytes_counts_payload_and_logits() -> None:
    assert chunk(b"x" * 10).nbytes == 10
    assert chunk(b"x" * 10, b"y" * 8).nbytes == 18


def test_seal_refuses_what_would_not_round_trip() -> None:
    with pytest.raises(ChunkError, match="empty logits"):
        seal(chunk(logits=b""), SECRET)
    with pytest.raises(ChunkError, match="0 tokens"):
        seal(chunk(tokens=0), SECRET)
    with pytest.raises(ChunkError, match="ASCII"):
        seal(Chunk("", 1, b"x"), SECRET)
    with pytest.raises(ChunkError, match="ASCII"):
        seal(Chunk("k\u00e9y", 1, b"x"), SECRET)


@settings(max_examples=200, deadline=None)
@given(
    payload=st.binary(max_size=300),
    logits=st.one_of(st.none(), st.binary(min_size=1, max_size=64)),
    tokens=st.integers(1, 2**32 - 1),
    key=st.text(st.characters(codec="ascii"), min_size=1, max_size=80),
)
def test_round_trip_property(payload: bytes, logits: bytes | None, tokens: int, key: str) -> None:
    c = Chunk(key, tokens, payload, logits)
    assert unseal(key, seal(c, SECRET), SECRET) == c


# -- refusals --------------------------------------------------------------------------------


def test_every_flipped_byte_is_refused() -> None:
    value = seal(chunk(bytes(range(40)), logits=b"\x01\x02\x03\x04"), SECRET)
    for i in range(len(value)):
        bad = bytearray(value)
        bad[i] ^= 0x01
        with pytest.raises(ChunkError):
            unseal(KEY, bad, SECRET)


def test_every_truncation_is_refused() -> None:
    value = seal(chunk(bytes(range(40)), logits=b"\x01\x02\x03\x04"), SECRET)
    for cut in range(len(value)):
        with pytest.raises(ChunkError, match="truncated"):
            unseal(KEY, value[:cut], SECRET)


def test_a_trailing_byte_is_refused() -> None:
    with pytest.raises(ChunkError, match="1 trailing bytes"):
        unseal(KEY, seal(chunk(), SECRET) + b"\0", SECRET)


def test_a_wrong_magic_is_refused() -> None:
    value = seal(chunk(), SECRET)
    with pytest.raises(ChunkError, match="not a sealed chunk"):
        unseal(KEY, b"SKPCHNK1" + value[8:], SECRET)


def test_a_value_under_another_key_is_refused() -> None:
    # A file renamed (or copied) to another key, e.g. the same page under another model's layout.
    other = chunk_key(PAGE, "0" * 32)
    with pytest.raises(ChunkError, match="sealed under key"):
        unseal(other, seal(chunk(), SECRET), SECRET)


def test_a_resealed_header_without_the_mac_is_refused() -> None:
    # Changing tokens alone (a consistent-looking header) still fails the MAC.
    value = bytearray(seal(chunk(tokens=4), SECRET))
    struct.pack_into("<I", value, len(MAGIC) + 2, 5)
    with pytest.raises(ChunkError, match="MAC mismatch"):
        unseal(KEY, value, SECRET)


def test_zero_tokens_is_refused_even_with_a_good_mac() -> None:
    head = struct.pack("<HIQQ", len(KEY), 0, 0, 3)
    body = head + KEY.encode()
    digest = blake3(body + b"abc", key=SECRET).digest()
    with pytest.raises(ChunkError, match="0 tokens"):
        unseal(KEY, MAGIC + body + digest + b"abc", SECRET)


# -- the keyed MAC -------------------------------------------------------------------------------


def test_a_value_sealed_with_another_secret_is_refused() -> None:
    other = derive_secret(b"another replica's secret, 32 bytes or more of it")
    with pytest.raises(ChunkError, match="MAC mismatch"):
        unseal(KEY, seal(chunk(), other), SECRET)


def test_a_value_forged_by_someone_who_knows_everything_but_the_secret_is_refused() -> None:
    # Keys are computable from model, namespace and tokens; the layout below is public (module
    # docstring). A plain BLAKE3 digest over it is what a writer without the secret can make.
    payload = b"state of the forger's choosing"
    body = struct.pack("<HIQQ", len(KEY), 4, 0, len(payload)) + KEY.encode()
    for digest in (blake3(body + payload).digest(), blake3(body + payload, key=bytes(32)).digest()):
        with pytest.raises(ChunkError, match="MAC mismatch"):
            unseal(KEY, MAGIC + body + digest + payload, SECRET)


def test_secret_material_is_stripped_and_must_be_long_enough() -> None:
    material = b"x" * MIN_SECRET_MATERIAL
    assert derive_secret(material + b"\n") == derive_secret(b"  " + material)
    assert derive_secret(material) != derive_secret(material + b"y")
    with pytest.raises(ChunkError, match="at least 32 bytes"):
        derive_secret(b"x" * (MIN_SECRET_MATERIAL - 1) + b"\n\n")


def test_only_a_key_of_the_right_size_seals() -> None:
    with pytest.raises(ChunkError, match="32 bytes"):
        seal(chunk(), b"short")
