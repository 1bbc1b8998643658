"""The sequence-state byte format: payloads written exactly as llama.cpp's writer does, cut and joined."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skippy_cache.stateformat import (
    FORMAT_VERSION,
    IO_MAGIC,
    LayerLayout,
    Layout,
    StateFormatError,
    format_version,
    join,
    parse,
    parse_sections,
    split,
    zeroed,
)

F16 = 1  # GGML_TYPE_F16
Q8_0 = 8  # GGML_TYPE_Q8_0


@dataclass
class Pool:
    """A KV pool as llama_kv_cache holds it: per cell a position, per layer a K and a V tensor."""

    kv_size: int
    pos: list[int]
    v_trans: bool
    # per layer: (k_type, k_row, k bytes of kv_size rows)
    k: list[tuple[int, int, bytes]] = field(default_factory=list)
    # per layer: (v_type, v_row, v bytes of kv_size rows) or, transposed,
    # (v_type, (v_el, n_embd), v bytes laid out as [n_embd][kv_size] elements)
    v: list[tuple[int, object, bytes]] = field(default_factory=list)


def make_pool(
    rng: np.random.Generator, kv_size: int, v_trans: bool, shapes: list[tuple[int, int, int]]
) -> Pool:
    """`shapes`: per layer (k_row, v_el, n_embd_v); non-transposed V rows are v_el * n_embd_v bytes."""
    pool = Pool(kv_size, [-1] * kv_size, v_trans)
    for k_row, v_el, n_embd in shapes:
        pool.k.append((F16, k_row, rng.integers(0, 256, kv_size * k_row, dtype=np.uint8).tobytes()))
        v = rng.integers(0, 256, kv_size * v_el * n_embd, dtype=np.uint8).tobytes()
        pool.v.append((F16, (v_el, n_embd) if v_trans else v_el * n_embd, v))
    return pool


def place(pool: Pool, cells: list[int]) -> list[int]:
    """Put positions 0..len-1 on the given cells (in that order)."""
    for p, i in enumerate(cells):
        pool.pos[i] = p
    return cells


def compacted(pool: Pool, cells: list[int]) -> Pool:
    """A pool of len(cells) cells whose cell p holds the rows of `cells[p]` (and position p).

    Its state is what a permuted state must read as: the same rows, sorted by position.
    """
    n = len(cells)
    out = Pool(n, list(range(n)), pool.v_trans)
    for k_type, k_row, k in pool.k:
        out.k.append((k_type, k_row, b"".join(k[i * k_row : (i + 1) * k_row] for i in cells)))
    for v_type, shape, v in pool.v:
        if not pool.v_trans:
            v_row = shape
            out.v.append((v_type, v_row, b"".join(v[i * v_row : (i + 1) * v_row] for i in cells)))
        else:
            v_el, n_embd = shape
            at = [(i + j * pool.kv_size) * v_el for j in range(n_embd) for i in cells]
            out.v.append((v_type, shape, b"".join(v[a : a + v_el] for a in at)))
    return out


def write_state(
    pool: Pool,
    seq_id: int,
    cells: list[int],
    *,
    n_stream: int = 1,
    ext: bool = False,
    skip_v_layer: int | None = None,
) -> bytes:
    """llama_context::state_seq_get_data + llama_kv_cache::state_write, line for line (one stream)."""
    out = bytearray()
    w = out.extend
    w(struct.pack("<I", IO_MAGIC))
    w(struct.pack("<i", seq_id))
    w(struct.pack("<I", n_stream))
    # the writer walks the cells in index order and groups the sequence's cells in ranges
    member = sorted(cells)
    ranges: list[tuple[int, int]] = []
    for i in member:
        if ranges and ranges[-1][1] == i:
            ranges[-1] = (ranges[-1][0], i + 1)
        else:
            ranges.append((i, i + 1))
    w(struct.pack("<I", len(member)))
    if not member:
        return bytes(out)
    for a, b in ranges:  # state_write_meta
        for i in range(a, b):
            w(struct.pack("<i", pool.pos[i]))
            w(struct.pack("<I", 1))
            if ext:  # llama_kv_cell_ext: x, y, tok
                w(struct.pack("<iii", 0, 0, 7))
            w(struct.pack("<i", seq_id))
    w(struct.pack("<I", 1 if pool.v_trans else 0))  # state_write_data
    w(struct.pack("<I", len(pool.k)))
    for k_type, k_row, k in pool.k:
        w(struct.pack("<i", k_type))
        w(struct.pack("<Q", k_row))
        for a, b in ranges:
            w(k[a * k_row : b * k_row])
    for il, (v_type, shape, v) in enumerate(pool.v):
        if il == skip_v_layer:  # `if (!v) continue;`
            continue
        w(struct.pack("<i", v_type))
        if not pool.v_trans:
            v_row = shape
            w(struct.pack("<Q", v_row))
            for a, b in ranges:
                w(v[a * v_row : b * v_row])
        else:
            v_el, n_embd = shape
            w(struct.pack("<I", v_el))
            w(struct.pack("<I", n_embd))
            for j in range(n_embd):
                for a, b in ranges:
                    src = (a + j * pool.kv_size) * v_el
                    w(v[src : src + (b - a) * v_el])
    return bytes(out)


SHAPES = [(8, 2, 3), (4, 2, 2), (6, 1, 5)]


def sample(v_trans: bool = False, n: int = 10, kv_size: int = 16, seq_id: int = 3) -> tuple[Pool, bytes]:
    pool = make_pool(np.random.default_rng(7), kv_size, v_trans, SHAPES)
    cells = place(pool, list(range(2, 2 + n)))
    return pool, write_state(pool, seq_id, cells)


def cuts(n: int, c: int) -> int:
    return -(-n // c)


# --- parse -----------------------------------------------------------------------------------


@pytest.mark.parametrize("v_trans", [False, True])
def test_parse_reports_cells_layout_and_row_offsets(v_trans: bool) -> None:
    pool, p = sample(v_trans)
    s = parse(p)
    assert (s.seq_id, s.n_tokens, s.positions) == (3, 10, range(10))
    assert s.layout.v_trans is v_trans
    assert s.layout.n_layer == 3
    assert [x.k_row_bytes for x in s.layout.layers] == [8, 4, 6]
    assert [x.v_row_bytes for x in s.layout.layers] == [6, 4, 5]
    assert all(x.k_type == F16 and x.v_type == F16 for x in s.layout.layers)
    if v_trans:
        assert [(x.v_el_bytes, x.n_embd_v_gqa) for x in s.layout.layers] == [(2, 3), (2, 2), (1, 5)]
    else:
        assert all(x.v_el_bytes == 0 and x.n_embd_v_gqa == 0 for x in s.layout.layers)
    assert s.layout.token_bytes == 8 + 4 + 6 + 6 + 4 + 5
    # the offsets slice the rows of pool cells 2.. (token t lives in cell 2 + t)
    for il, (_, k_row, k) in enumerate(pool.k):
        assert s.k_rows(il, 1, 4) == k[3 * k_row : 6 * k_row]
    _, shape, v = pool.v[1]
    if v_trans:
        el, n_embd = shape
        want = b"".join(v[(3 + j * 16) * el : (6 + j * 16) * el] for j in range(n_embd))
    else:
        want = v[3 * shape : 6 * shape]
    assert s.v_rows(1, 1, 4) == want


def test_parse_accepts_a_bytearray_and_fragmented_cells_in_position_order() -> None:
    pool = make_pool(np.random.default_rng(1), 12, False, SHAPES)
    cells = place(pool, [0, 1, 4, 5, 6, 9])
    p = bytearray(write_state(pool, 0, cells))
    s = parse(p)
    assert s.n_tokens == 6
    assert s.k_rows(0, 2, 3) == pool.k[0][2][4 * 8 : 5 * 8]
    assert join(s.layout, split(s, 4), 6) == bytes(p)
    p.extend(b"x")  # the state holds no buffer export: the caller's bytearray stays resizable


# --- refusals --------------------------------------------------------------------------------


def refused(payload: bytes, match: str) -> None:
    with pytest.raises(StateFormatError, match=match):
        parse(payload)


def patched(p: bytes, fmt: str, offset: int, *values: int) -> bytes:
    b = bytearray(p)
    struct.pack_into(fmt, b, offset, *values)
    return bytes(b)


def test_refuses_a_wrong_magic() -> None:
    refused(patched(sample()[1], "<I", 0, 0xDEADBEEF), "magic")


def test_refuses_a_whole_context_header() -> None:
    refused(patched(sample()[1], "<i", 4, -1), "whole-context")


@pytest.mark.parametrize("n_stream", [0, 2, 8])
def test_refuses_a_stream_count_other_than_one(n_stream: int) -> None:
    refused(patched(sample()[1], "<I", 8, n_stream), "n_stream")


def test_refuses_an_empty_sequence() -> None:
    pool = make_pool(np.random.default_rng(0), 4, False, SHAPES)
    p = write_state(pool, 0, [])
    assert len(p) == 16
    refused(p, "empty")


@pytest.mark.parametrize("v_trans", [False, True])
def test_refuses_every_truncation(v_trans: bool) -> None:
    _, p = sample(v_trans, n=3)
    for k in range(len(p)):
        refused(p[:k], "truncated")


def test_refuses_trailing_bytes() -> None:
    _, p = sample()
    refused(p + b"\0", "trailing")


def test_refuses_two_kv_caches_back_to_back() -> None:
    # llama_kv_cache_iswa::state_write writes the base cache's state, then the SWA cache's.
    _, p = sample()
    refused(p + p[8:], "trailing")


@pytest.mark.parametrize("v_trans", [False, True])
def test_parse_sections_reads_each_kv_cache_of_a_sliding_window_state(v_trans: bool) -> None:
    _, base = sample(v_trans, n=10)
    _, window = sample(v_trans, n=4, seq_id=3)
    both = base + window[8:]  # one header; the window cache's section follows the base cache's
    sections = parse_sections(both)
    assert [s.n_tokens for s in sections] == [10, 4]
    assert sections[0].layout == parse(base).layout == sections[1].layout
    assert sections[1].k_rows(0, 0, 4) == parse(window).k_rows(0, 0, 4)
    assert parse_sections(base) == (parse(base),)
    with pytest.raises(StateFormatError, match="truncated"):
        parse_sections(both[:-1])


def test_refuses_positions_not_starting_at_zero() -> None:
    refused(patched(sample()[1], "<i", 16, 1), r"cell 0 is at pos 1")


def test_refuses_a_gap_in_positions() -> None:
    pool = make_pool(np.random.default_rng(0), 8, False, SHAPES)
    place(pool, [0, 1, 2])
    pool.pos[2] = 3
    refused(write_state(pool, 0, [0, 1, 2]), r"cell 2 is at pos 3")


def test_refuses_a_gap_in_permuted_positions() -> None:
    pool = make_pool(np.random.default_rng(0), 8, False, SHAPES)
    place(pool, [4, 5, 0, 1])
    pool.pos[0] = 7  # cells 0, 1, 4, 5 hold positions 7, 3, 0, 1: no 2
    refused(write_state(pool, 0, [0, 1, 4, 5]), r"cell 0 is at pos 7")
    pool.pos[0] = -1
    refused(write_state(pool, 0, [0, 1, 4, 5]), r"cell 0 is at pos -1")


def test_refuses_a_duplicate_position() -> None:
    pool = make_pool(np.random.default_rng(0), 8, False, SHAPES)
    place(pool, [4, 5, 0, 1])
    pool.pos[1] = 0  # cells 0, 1, 4, 5 hold positions 2, 0, 0, 1: no 3, 0 twice
    refused(write_state(pool, 0, [0, 1, 4, 5]), r"cell 1 is at pos 0, and so is cell 2")


@pytest.mark.parametrize("v_trans", [False, True])
def test_accepts_cells_that_wrapped_around_the_pool_and_reads_them_in_position_order(v_trans: bool) -> None:
    # find_slot wraps: positions 0,1 went to the last cells, 2,3 to the first; the writer goes by cell index,
    # so the payload holds positions 2, 3, 0, 1.
    pool = make_pool(np.random.default_rng(0), 6, v_trans, SHAPES)
    cells = place(pool, [4, 5, 0, 1])
    p = write_state(pool, 3, cells)
    s = parse(p)
    assert (s.n_tokens, s.positions) == (4, range(4))
    assert s.order is not None and list(s.order) == [2, 3, 0, 1]
    k_row = pool.k[0][1]
    assert s.k_rows(0, 0, 2) == pool.k[0][2][4 * k_row : 6 * k_row]
    assert s.k_rows(0, 1, 3) == pool.k[0][2][5 * k_row : 6 * k_row] + pool.k[0][2][0:k_row]
    sorted_p = write_state(compacted(pool, cells), 3, list(range(4)))
    assert parse(sorted_p).order is None
    assert parse(sorted_p).layout == s.layout
    for c in (1, 3, 4):
        assert join(s.layout, split(s, c), 4, seq_id=3) == sorted_p
        assert split(s, c) == split(parse(sorted_p), c)


def test_refuses_a_cell_shared_by_two_sequences() -> None:
    _, p = sample(n=2, seq_id=0)
    # a whole-context style cell: pos 0, n_seq_id 2, seqs 0 and 1
    p = p[:16] + struct.pack("<iIii", 0, 2, 0, 1) + p[28:]
    refused(p, "n_seq_id=2")


def test_refuses_a_cell_of_another_sequence() -> None:
    refused(patched(sample(seq_id=3)[1], "<i", 16 + 12 * 4 + 8, 5), "cell 4 belongs to seq 5")


def test_refuses_cells_with_ext_data() -> None:
    # M-RoPE / PLE models write llama_kv_cell_ext (12 bytes) after n_seq_id
    pool = make_pool(np.random.default_rng(0), 8, False, SHAPES)
    with pytest.raises(StateFormatError):
        parse(write_state(pool, 0, place(pool, [0, 1, 2]), ext=True))


def test_refuses_a_layer_without_v() -> None:
    pool = make_pool(np.random.default_rng(0), 8, False, SHAPES)
    with pytest.raises(StateFormatError):
        parse(write_state(pool, 0, place(pool, [0, 1, 2]), skip_v_layer=1))


@pytest.mark.parametrize("value", [2, 7, 0xFFFFFFFF])
def test_refuses_an_unknown_v_trans(value: int) -> None:
    refused(patched(sample(n=10)[1], "<I", 16 + 12 * 10, value), "v_trans")


def test_refuses_zero_layers() -> None:
    _, p = sample(n=2)
    at = 16 + 12 * 2
    refused(p[: at + 4] + struct.pack("<I", 0), "n_layer=0")


def test_refuses_a_negative_type_and_a_zero_row() -> None:
    _, p = sample(n=2)
    k0 = 16 + 12 * 2 + 8
    refused(patched(p, "<i", k0, -1), "negative ggml type")
    zero = make_pool(np.random.default_rng(0), 4, False, [(0, 2, 2)])
    refused(write_state(zero, 0, place(zero, [0])), "zero bytes")


def test_refuses_a_row_size_that_disagrees_with_the_length() -> None:
    _, p = sample(n=2)
    with pytest.raises(StateFormatError):
        parse(patched(p, "<Q", 16 + 12 * 2 + 8 + 4, 9))


# --- split / join ----------------------------------------------------------------------------


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("c", [1, 3, 4, 10, 64])
def test_split_join_round_trip(v_trans: bool, c: int) -> None:
    _, p = sample(v_trans, n=10)
    s = parse(p)
    chunks = split(s, c)
    assert len(chunks) == cuts(10, c)
    assert [s.layout.tokens_in(x) for x in chunks] == [min(c, 10 - i * c) for i in range(len(chunks))]
    assert join(s.layout, chunks, 10, seq_id=3) == p


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize(("c", "m"), [(4, 1), (4, 4), (4, 5), (4, 9), (3, 7), (1, 6), (64, 2)])
def test_partial_join_equals_the_shorter_sequence(v_trans: bool, c: int, m: int) -> None:
    pool, p = sample(v_trans, n=10, seq_id=0)
    chunks = split(parse(p), c)
    shorter = write_state(pool, 0, list(range(2, 2 + m)))
    assert join(parse(p).layout, chunks[: cuts(m, c)], m) == shorter
    assert parse(shorter).n_tokens == m


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize(("c", "skip", "m"), [(4, 1, 6), (4, 2, 1), (3, 1, 7), (1, 9, 1)])
def test_chunks_from_the_middle_join_as_the_later_positions(v_trans: bool, c: int, skip: int, m: int) -> None:
    # What llama.cpp writes for a sequence that holds only positions [skip*c, skip*c + m) of the
    # same rows: the import puts them back at those positions, after cells shared by seq_cp.
    pool, p = sample(v_trans, n=10, seq_id=0)
    chunks = split(parse(p), c)
    start = skip * c
    later = write_state(pool, 0, list(range(2 + start, 2 + start + m)))
    assert join(parse(p).layout, chunks[skip : cuts(start + m, c)], m, start=start) == later


@pytest.mark.parametrize("v_trans", [False, True])
def test_join_into_a_kept_buffer_writes_the_same_payload(v_trans: bool) -> None:
    pool, p = sample(v_trans, n=10, seq_id=0)
    s = parse(p)
    chunks = split(s, 4)
    buffer = bytearray(b"\xee" * (len(p) + 100))  # larger, and full of an earlier restore's bytes
    joined = join(s.layout, chunks, 10, into=buffer)
    assert isinstance(joined, memoryview) and joined.obj is buffer and joined == p
    shorter = join(s.layout, chunks[:2], 5, into=buffer)  # the same buffer again, a shorter payload
    assert shorter == write_state(pool, 0, list(range(2, 7)))
    small = bytearray(len(p) - 1)
    assert isinstance(join(s.layout, chunks, 10, into=small), bytearray) and small == bytearray(len(p) - 1)


def test_join_writes_the_seq_id_it_is_given() -> None:
    pool, p = sample(n=5, seq_id=3)
    s = parse(p)
    q = join(s.layout, split(s, 2), 5)  # default seq 0: the reader ignores it
    assert parse(q).seq_id == 0
    assert q == write_state(pool, 0, list(range(2, 7)))


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("n", [1, 7, 64])
def test_zeroed_is_a_join_of_zero_rows(v_trans: bool, n: int) -> None:
    # Placement pads: the payload a join of all-zero rows would make, built without the rows' copy.
    layout = parse(sample(v_trans)[1]).layout
    pad = zeroed(layout, n, seq_id=9)
    assert pad == join(layout, [bytes(n * layout.token_bytes)], n, seq_id=9)
    assert parse(pad).n_tokens == n
    with pytest.raises(StateFormatError):
        zeroed(layout, 0)


def test_join_refuses_misuse() -> None:
    _, p = sample(n=10)
    s = parse(p)
    chunks = split(s, 4)  # 4, 4, 2 tokens
    with pytest.raises(StateFormatError, match="at least 1"):
        join(s.layout, chunks, 0)
    with pytest.raises(StateFormatError, match="no chunks"):
        join(s.layout, [], 3)
    with pytest.raises(StateFormatError, match="hold 10 tokens, 11"):
        join(s.layout, chunks, 11)
    with pytest.raises(StateFormatError, match="past n_tokens=4"):
        join(s.layout, chunks[:2] + chunks[2:], 4)
    with pytest.raises(StateFormatError, match="whole number"):
        join(s.layout, [chunks[0][:-1]], 3)
    with pytest.raises(StateFormatError, match="whole number"):
        join(s.layout, [b""], 1)
    with pytest.raises(StateFormatError, match="not a sequence id"):
        join(s.layout, chunks, 10, seq_id=-1)
    with pytest.raises(StateFormatError, match="not a position"):
        join(s.layout, chunks, 10, start=-1)
    with pytest.raises(StateFormatError, match="at least 1"):
        split(s, 0)


def test_join_refuses_chunks_cut_under_another_layout() -> None:
    _, p = sample(n=4)
    other = parse(sample(n=4)[1]).layout
    wider = Layout(other.v_trans, other.layers + (LayerLayout(F16, 2, F16, 2),))
    with pytest.raises(StateFormatError, match="whole number"):
        join(wider, split(parse(p), 4), 4)


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    v_trans=st.booleans(),
    shapes=st.lists(
        st.tuples(st.integers(1, 12), st.sampled_from([1, 2, 4]), st.integers(1, 5)), min_size=1, max_size=4
    ),
    n=st.integers(1, 40),
    spare=st.integers(0, 8),
    c=st.integers(1, 45),
    seq_id=st.integers(0, 63),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_property(data, v_trans, shapes, n, spare, c, seq_id, seed) -> None:
    pool = make_pool(np.random.default_rng(seed), n + spare, v_trans, shapes)
    cells = data.draw(st.permutations(range(n + spare)))[:n]  # fragmented, positions in any cell order
    in_order = data.draw(st.booleans())
    if in_order:
        cells = sorted(cells)
    place(pool, cells)
    p = write_state(pool, seq_id, cells)
    s = parse(p)
    assert (s.n_tokens, s.seq_id) == (n, seq_id)
    assert (s.order is None) == (cells == sorted(cells))
    chunks = split(s, c)
    whole = join(s.layout, chunks, n, seq_id=seq_id)
    assert whole == write_state(compacted(pool, cells), seq_id, list(range(n)))
    if in_order:
        assert whole == p
    m = data.draw(st.integers(1, n))
    want = write_state(compacted(pool, cells[:m]), seq_id, list(range(m)))
    assert join(s.layout, chunks[: cuts(m, c)], m, seq_id=seq_id) == want


# --- identity --------------------------------------------------------------------------------


def smollm2_layout(**change: object) -> Layout:
    layer = dict(k_type=F16, k_row_bytes=384, v_type=F16, v_row_bytes=384)
    layer.update(change)
    return Layout(False, (LayerLayout(**layer),) * 30)  # type: ignore[arg-type]


def test_fingerprint_is_stable() -> None:
    # Regression pin: a changed value means every stored chunk stops matching.
    assert smollm2_layout().fingerprint() == "f7bfaaf7df25880c76c7941bcfba22d6"
    assert format_version() == FORMAT_VERSION


def test_fingerprint_tells_every_layout_field_apart() -> None:
    base = smollm2_layout()
    variants = [
        smollm2_layout(k_type=Q8_0),
        smollm2_layout(k_row_bytes=408),
        smollm2_layout(v_type=Q8_0),
        smollm2_layout(v_row_bytes=408),
        Layout(True, (LayerLayout(F16, 384, F16, 384, 2, 192),) * 30),
        Layout(False, base.layers[:29]),
    ]
    prints = {base.fingerprint()} | {v.fingerprint() for v in variants}
    assert len(prints) == 1 + len(variants)


def test_the_fingerprint_of_a_parsed_layout_is_that_of_its_header() -> None:
    _, p = sample(n=3)
    s = parse(p)
    at = 16 + 12 * 3
    assert s.layout.header_bytes()[:8] == p[at : at + 8]
    assert s.layout == parse(sample(n=5)[1]).layout


def test_zeroed_writes_one_section_per_layout() -> None:
    base = parse(sample(False)[1]).layout
    window = parse(sample(True)[1]).layout
    pad = zeroed((base, window), 5, seq_id=2)
    sections = parse_sections(pad)
    assert [(s.n_tokens, s.layout) for s in sections] == [(5, base), (5, window)]
    assert pad == zeroed(base, 5, seq_id=2) + zeroed(window, 5, seq_id=2)[8:]
