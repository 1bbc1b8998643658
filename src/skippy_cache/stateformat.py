"""The byte format of one sequence's KV state, cut into token chunks and joined back.

The payload is what `llama_state_seq_get_data(ctx, dst, size, seq_id)` writes
(flags 0) and `llama_state_seq_set_data` reads, in llama-cpp-python 0.3.36's
vendored llama.cpp (`llama_context::state_seq_get_data`, then
`llama_kv_cache::state_write` / `state_write_meta` / `state_write_data`).
Integers are host order; we read them little-endian, and the runtime ABI in the
identity keeps a payload on the machine kind that wrote it.

    u32 io_magic (0xaf143cd8)     i32 seq_id (the source sequence; ignored on import)
    u32 n_stream                  per stream: u32 cell_count, and if it is not 0:
      per cell, in cell-index order:  i32 pos, u32 n_seq_id, i32 seq_id * n_seq_id
      u32 v_trans, u32 n_layer
      per layer: i32 k_type, u64 k_row_bytes, cell_count K rows
      v_trans 0, per layer: i32 v_type, u64 v_row_bytes, cell_count V rows
      v_trans 1, per layer: i32 v_type, u32 v_el_bytes, u32 n_embd_v_gqa,
                 then per embedding element j, the run of cell_count values

What we accept, and refuse anything else (`StateFormatError`): one stream
(`kv_unified`), at least one cell, every cell holding only the header's
sequence, positions a permutation of 0..n-1 (no gap, no duplicate, no shifted
start), a V section for every layer, no trailing byte.

Payload order is the pool's cell order, not position order: in a fragmented
pool a sequence's cells come out as e.g. 5,6,0,1,... A row belongs to its
position, not to its cell (K is stored already rotated for its position, and
attention masks by position), so the state is the set of (position, rows)
pairs whatever the cell order. `SeqState` reads rows in position order:
`k_rows`, `v_rows` and `split` gather through `SeqState.order` when the
payload is permuted, so every chunk is position-ordered. `join` writes cells
in position order, so `join(split(p)) == p` for an in-order payload, and for a
permuted one it is the same sequence with cells and rows sorted by position.

Out of scope and refused by the checks above:
- models whose cells carry `llama_kv_cell_ext` (M-RoPE, PLE) write 12 more
  bytes per cell; they break the 12-byte cell stride and are refused;
- memories that write more than one KV cache leave trailing bytes after the
  first; layers without V (`if (!v) continue`) come out short. A sliding-window
  model writes its full-attention layers' cache and then its window layers'
  (`llama_kv_cache_iswa::state_write`): `parse_sections` reads both, each
  section as above, for deterministic mode's pads (`zeroed` of both layouts).
  The window section holds only the cells the window still needs, so such a
  state is not cut into chunks. A recurrent memory's section is another format
  altogether, refused.

A chunk is the raw rows of a run of tokens, nothing else: every layer's K rows,
then every layer's V rows (transposed V: per layer, per embedding element, the
run of the chunk's values). Its token count is its length over
`Layout.token_bytes`; positions follow from its index, since chunks are joined
consecutively from token 0. What is not in a chunk is the `Layout`, which must
be equal for chunks to be joined: put `Layout.fingerprint()` and
`FORMAT_VERSION` into the identity of anything stored.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

#: `io_magic` in llama-context.cpp: the first word of every sequence state.
IO_MAGIC = 0xAF143CD8

#: Names the format this module reads and writes. It goes into cache
#: identities so that a state written under another build is never imported
#: into ours: the format has no version field of its own (LLAMA_STATE_SEQ_VERSION
#: versions the file wrapper only), so we pin the vendored source we read.
FORMAT_VERSION = "llama.cpp-seq-state/io_magic=af143cd8/kv-cache-1/llama-cpp-python-0.3.36"

_MAGIC_SEQ = struct.Struct("<Ii")  # magic, seq_id: the context writes them, then each KV cache its section
_HEAD = struct.Struct("<IiII")  # magic, seq_id, n_stream, cell_count (of the only stream)
_CELL_BYTES = 12  # i32 pos, u32 n_seq_id = 1, i32 seq_id
_U32X2 = struct.Struct("<II")
_ROW_HEAD = struct.Struct("<iQ")  # type, row bytes
_TRANS_HEAD = struct.Struct("<iII")  # type, element bytes, n_embd_v_gqa


def format_version() -> str:
    return FORMAT_VERSION


class StateFormatError(ValueError):
    """A payload or chunk this module does not understand, or a misuse of split/join."""


@dataclass(frozen=True, slots=True)
class LayerLayout:
    k_type: int  # ggml_type id
    k_row_bytes: int  # one cell's K row: ggml_row_size(k_type, n_embd_k_gqa)
    v_type: int
    v_row_bytes: int  # one cell's V bytes: ggml_row_size, or v_el_bytes * n_embd_v_gqa when transposed
    v_el_bytes: int = 0  # transposed V only (0 otherwise): ggml_type_size(v_type)
    n_embd_v_gqa: int = 0  # transposed V only (0 otherwise)


@dataclass(frozen=True, slots=True)
class Layout:
    """Everything in a payload that is not cells or rows; equal layouts are what makes chunks joinable."""

    v_trans: bool
    layers: tuple[LayerLayout, ...]

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's rows over all layers, K and V: the size of a one-token chunk."""
        return sum(x.k_row_bytes + x.v_row_bytes for x in self.layers)

    def header_bytes(self) -> bytes:
        """The layout exactly as the payload spells it, rows left out (also the fingerprint's input)."""
        parts = [_U32X2.pack(int(self.v_trans), self.n_layer)]
        parts += [_ROW_HEAD.pack(x.k_type, x.k_row_bytes) for x in self.layers]
        if self.v_trans:
            parts += [_TRANS_HEAD.pack(x.v_type, x.v_el_bytes, x.n_embd_v_gqa) for x in self.layers]
        else:
            parts += [_ROW_HEAD.pack(x.v_type, x.v_row_bytes) for x in self.layers]
        return b"".join(parts)

    def fingerprint(self) -> str:
        """A stable hex digest of the format version and the layout, for cache identities."""
        h = hashlib.blake2b(digest_size=16)
        h.update(FORMAT_VERSION.encode())
        h.update(b"\0")
        h.update(self.header_bytes())
        return h.hexdigest()

    def tokens_in(self, chunk: bytes | bytearray | memoryview) -> int:
        """How many tokens a chunk of this layout holds; refuses a length that is not whole tokens."""
        n, rest = divmod(len(chunk), self.token_bytes)
        if rest or n == 0:
            raise StateFormatError(
                f"chunk of {len(chunk)} bytes is not a positive whole number of {self.token_bytes}-byte "
                "tokens: it was cut under another layout, or truncated"
            )
        return n


@dataclass(frozen=True, slots=True)
class SeqState:
    """A parsed payload: a view, the bytes stay in `payload` (the caller must not mutate them)."""

    payload: bytes | bytearray | memoryview
    seq_id: int  # the sequence it was read from; llama.cpp ignores it on import (flags 0)
    n_tokens: int  # cell count; the positions are a permutation of 0..n_tokens-1
    layout: Layout
    k_offsets: tuple[int, ...]  # per layer: payload offset of its first K row
    v_offsets: tuple[int, ...]  # per layer: payload offset of its first V row (transposed: first run)
    #: order[p] is the payload row (cell) holding position p; None when the payload is in position
    #: order (the common case, read by slicing). Left out of ==: an ndarray has no truth value.
    order: np.ndarray | None = field(default=None, compare=False)

    @property
    def positions(self) -> range:
        """The positions held; rows are read in this order, whatever the payload's cell order."""
        return range(self.n_tokens)

    def k_rows(self, layer: int, start: int, stop: int) -> bytes:
        """Positions [start, stop) of one layer's K rows, in position order."""
        row = self.layout.layers[layer].k_row_bytes
        off = self.k_offsets[layer]
        if self.order is None:
            return bytes(memoryview(self.payload)[off + start * row : off + stop * row])
        k = np.frombuffer(self.payload, np.uint8, count=self.n_tokens * row, offset=off)
        return k.reshape(self.n_tokens, row)[self.order[start:stop]].tobytes()

    def v_rows(self, layer: int, start: int, stop: int) -> bytes:
        """Positions [start, stop) of one layer's V, in chunk order (transposed: a run per element)."""
        x = self.layout.layers[layer]
        off = self.v_offsets[layer]
        if not self.layout.v_trans:
            row = x.v_row_bytes
            if self.order is None:
                return bytes(memoryview(self.payload)[off + start * row : off + stop * row])
            v = np.frombuffer(self.payload, np.uint8, count=self.n_tokens * row, offset=off)
            return v.reshape(self.n_tokens, row)[self.order[start:stop]].tobytes()
        run = self.n_tokens * x.v_el_bytes
        v = np.frombuffer(self.payload, np.uint8, count=x.n_embd_v_gqa * run, offset=off)
        if self.order is None:
            return v.reshape(x.n_embd_v_gqa, run)[:, start * x.v_el_bytes : stop * x.v_el_bytes].tobytes()
        # [element][cell][element bytes]: gather the cells of each element's run.
        runs = v.reshape(x.n_embd_v_gqa, self.n_tokens, x.v_el_bytes)
        return runs[:, self.order[start:stop], :].tobytes()


class _Reader:
    def __init__(self, payload: bytes | bytearray | memoryview) -> None:
        self.buf = payload
        self.pos = 0

    def need(self, n: int, what: str) -> int:
        """Advance past `n` bytes of `what`; returns where they start."""
        start = self.pos
        if n > len(self.buf) - start:
            raise StateFormatError(
                f"truncated sequence state: {what} needs {n} bytes at offset {start}, "
                f"{len(self.buf) - start} left of {len(self.buf)}"
            )
        self.pos += n
        return start

    def unpack(self, st: struct.Struct, what: str) -> tuple[int, ...]:
        return st.unpack_from(self.buf, self.need(st.size, what))


def parse(payload: bytes | bytearray | memoryview) -> SeqState:
    """Read a payload of `llama_state_seq_get_data` (flags 0); refuses all the module docstring leaves out."""
    r, seq_id = _header(payload)
    state = _section(r, payload, seq_id)
    if r.pos != len(payload):
        raise StateFormatError(
            f"{len(payload) - r.pos} trailing bytes after the last layer's V at offset {r.pos}: "
            "a second KV cache (iSWA, hybrid memory) or another writer"
        )
    return state


def parse_sections(payload: bytes | bytearray | memoryview) -> tuple[SeqState, ...]:
    """Read a payload that holds one KV cache after another, as a sliding-window model writes it
    (the full-attention layers' cache, then the window layers'); each section as `parse` reads one."""
    r, seq_id = _header(payload)
    sections = [_section(r, payload, seq_id)]
    while r.pos != len(payload):
        sections.append(_section(r, payload, seq_id))
    return tuple(sections)


def _header(payload: bytes | bytearray | memoryview) -> tuple[_Reader, int]:
    r = _Reader(payload)
    magic, seq_id = r.unpack(_MAGIC_SEQ, "header")
    if magic != IO_MAGIC:
        raise StateFormatError(f"not a sequence state: magic {magic:#010x}, expected {IO_MAGIC:#010x}")
    if seq_id < 0:
        raise StateFormatError(f"header seq_id {seq_id}: a whole-context state, not one sequence's")
    return r, seq_id


def _section(r: _Reader, payload: bytes | bytearray | memoryview, seq_id: int) -> SeqState:
    """One KV cache's part of a payload, from its stream count to its last V row."""
    n_stream, n = r.unpack(_U32X2, "stream and cell counts")
    if n_stream != 1:
        # One stream is kv_unified; with one stream per sequence, the stream count
        # becomes part of the layout and every empty stream writes a zero count.
        raise StateFormatError(f"n_stream={n_stream}: only a unified KV cache (n_stream=1) is supported")
    if n == 0:
        raise StateFormatError("empty sequence state (cell_count=0): it has no layout and nothing to reuse")

    cells_at = r.need(n * _CELL_BYTES, f"{n} cells of metadata")
    cells = np.frombuffer(payload, "<i4", count=3 * n, offset=cells_at).reshape(n, 3)
    # Checked in this order because the 12-byte stride holds only up to the first
    # cell with n_seq_id != 1; past it, the later columns are misaligned.
    bad = np.flatnonzero(cells[:, 1] != 1)
    if bad.size:
        i = int(bad[0])
        raise StateFormatError(
            f"cell {i} has n_seq_id={int(cells[i, 1])}: only single-sequence cells are supported"
        )
    order = _position_order(cells[:, 0])
    bad = np.flatnonzero(cells[:, 2] != seq_id)
    if bad.size:
        i = int(bad[0])
        raise StateFormatError(f"cell {i} belongs to seq {int(cells[i, 2])}, the header says seq {seq_id}")

    v_trans, n_layer = r.unpack(_U32X2, "v_trans and n_layer")
    if v_trans not in (0, 1):
        raise StateFormatError(f"unknown v_trans value {v_trans}")
    if n_layer == 0:
        raise StateFormatError("n_layer=0: no rows to reuse")

    k_heads: list[tuple[int, int]] = []
    k_offsets: list[int] = []
    for il in range(n_layer):
        k_type, k_row = r.unpack(_ROW_HEAD, f"layer {il} K header")
        _check_type_and_size(k_type, k_row, f"layer {il} K")
        k_heads.append((k_type, k_row))
        k_offsets.append(r.need(n * k_row, f"layer {il} K rows"))

    layers: list[LayerLayout] = []
    v_offsets: list[int] = []
    for il, (k_type, k_row) in enumerate(k_heads):
        if v_trans:
            v_type, v_el, n_embd = r.unpack(_TRANS_HEAD, f"layer {il} V header (transposed)")
            _check_type_and_size(v_type, v_el * n_embd, f"layer {il} V")
            layers.append(LayerLayout(k_type, k_row, v_type, v_el * n_embd, v_el, n_embd))
            v_offsets.append(r.need(n * v_el * n_embd, f"layer {il} V runs"))
        else:
            v_type, v_row = r.unpack(_ROW_HEAD, f"layer {il} V header")
            _check_type_and_size(v_type, v_row, f"layer {il} V")
            layers.append(LayerLayout(k_type, k_row, v_type, v_row))
            v_offsets.append(r.need(n * v_row, f"layer {il} V rows"))

    layout = Layout(bool(v_trans), tuple(layers))
    return SeqState(payload, seq_id, n, layout, tuple(k_offsets), tuple(v_offsets), order)


def _position_order(pos: np.ndarray) -> np.ndarray | None:
    """For positions that are a permutation of 0..n-1, the payload row of each position (None if in order).

    Refuses anything else: a position outside 0..n-1 means a gap or a shifted
    start, and n positions inside it that are not all distinct mean a duplicate.
    """
    n = len(pos)
    if np.array_equal(pos, np.arange(n)):
        return None
    bad = np.flatnonzero((pos < 0) | (pos >= n))
    if bad.size:
        i = int(bad[0])
        raise StateFormatError(
            f"positions are not a permutation of 0..{n - 1}: cell {i} is at pos {int(pos[i])} "
            "(a gap or a shifted start)"
        )
    seen = np.bincount(pos, minlength=n)
    bad = np.flatnonzero(seen[pos] > 1)
    if bad.size:
        i = int(bad[0])  # the first cell holding a repeated position
        j = int(np.flatnonzero(pos == pos[i])[1])  # the next cell holding it
        raise StateFormatError(
            f"positions are not a permutation of 0..{n - 1}: cell {i} is at pos {int(pos[i])}, "
            f"and so is cell {j}"
        )
    order = np.empty(n, np.intp)
    order[pos] = np.arange(n)
    return order


def _check_type_and_size(type_id: int, row_bytes: int, what: str) -> None:
    if type_id < 0:
        raise StateFormatError(f"{what}: negative ggml type {type_id}")
    if row_bytes == 0:
        # A zero row makes a token's size 0, and chunk lengths stop telling token counts.
        raise StateFormatError(f"{what}: zero bytes per cell")


def split(state: SeqState, chunk_tokens: int) -> list[bytes]:
    """The state's rows in position order, cut into chunks of `chunk_tokens` tokens from position 0.

    The last chunk may be short.
    """
    if chunk_tokens < 1:
        raise StateFormatError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    n_layer = state.layout.n_layer
    chunks = []
    for a in range(0, state.n_tokens, chunk_tokens):
        b = min(a + chunk_tokens, state.n_tokens)
        parts = [state.k_rows(il, a, b) for il in range(n_layer)]
        parts += [state.v_rows(il, a, b) for il in range(n_layer)]
        chunks.append(b"".join(parts))
    return chunks


def join(
    layout: Layout,
    chunks: Sequence[bytes | bytearray | memoryview],
    n_tokens: int,
    *,
    seq_id: int = 0,
    start: int = 0,
    into: bytearray | None = None,
) -> bytearray | memoryview:
    """A payload for `llama_state_seq_set_data` holding the first `n_tokens` tokens of consecutive chunks.

    `n_tokens` must end inside the last chunk given (no chunk wholly past it).
    The rows sit at positions `start`, `start + 1`, ...: chunks taken from the
    middle of a sequence import as its later positions, so a sequence whose
    leading cells are shared with another (`seq_cp`) gets only the rest.
    `seq_id` goes into the header and every cell, as the writer puts it; the
    reader ignores both (flags 0), so any value imports into any sequence. Pass
    the state's own `seq_id` for a byte-exact round trip. A bytearray: the
    import reads it in place instead of copying it once more. With `into` at
    least as long as the payload, it is written there and a view of it comes
    back: a buffer used again is not faulted in page by page again.
    """
    if n_tokens < 1:
        raise StateFormatError(f"n_tokens must be at least 1, got {n_tokens}")
    if not 0 <= seq_id < 2**31:
        raise StateFormatError(f"seq_id {seq_id} is not a sequence id")
    if not 0 <= start < 2**31 - n_tokens:
        raise StateFormatError(f"start {start} is not a position for {n_tokens} tokens")
    if not chunks:
        raise StateFormatError("no chunks to join")
    counts = [layout.tokens_in(c) for c in chunks]
    total = sum(counts)
    if total < n_tokens:
        raise StateFormatError(f"the chunks hold {total} tokens, {n_tokens} were asked for")
    if total - counts[-1] >= n_tokens:
        raise StateFormatError(
            f"the last chunk starts at token {total - counts[-1]}, past n_tokens={n_tokens}: "
            "pass only the chunks that cover the tokens"
        )
    # How many of each chunk's tokens are used: all of them but in the last chunk.
    takes = counts[:-1] + [n_tokens - (total - counts[-1])]

    parts: list[bytes | memoryview] = [_cells_head(layout, n_tokens, seq_id, start)]

    views = [memoryview(c).cast("B") for c in chunks]
    k_total = sum(x.k_row_bytes for x in layout.layers)
    k_before = 0  # bytes per token of the layers before this one, K section
    for x in layout.layers:
        parts.append(_ROW_HEAD.pack(x.k_type, x.k_row_bytes))
        for view, count, take in zip(views, counts, takes, strict=True):
            off = count * k_before
            parts.append(view[off : off + take * x.k_row_bytes])
        k_before += x.k_row_bytes

    v_before = 0  # same for the V section, which starts after all of the chunk's K
    for x in layout.layers:
        if layout.v_trans:
            parts.append(_TRANS_HEAD.pack(x.v_type, x.v_el_bytes, x.n_embd_v_gqa))
            runs = []
            for view, count, take in zip(views, counts, takes, strict=True):
                off = count * (k_total + v_before)
                v = np.frombuffer(view, np.uint8, count=count * x.v_row_bytes, offset=off)
                runs.append(v.reshape(x.n_embd_v_gqa, count * x.v_el_bytes)[:, : take * x.v_el_bytes])
            parts.append(np.hstack(runs).tobytes())
        else:
            parts.append(_ROW_HEAD.pack(x.v_type, x.v_row_bytes))
            for view, count, take in zip(views, counts, takes, strict=True):
                off = count * (k_total + v_before)
                parts.append(view[off : off + take * x.v_row_bytes])
        v_before += x.v_row_bytes
    size = sum(len(part) for part in parts)
    if into is None or len(into) < size:
        return bytearray().join(parts)
    out = memoryview(into)[:size]
    at = 0
    for part in parts:
        out[at : at + len(part)] = part
        at += len(part)
    return out


def zeroed(layout: Layout | Sequence[Layout], n_tokens: int, *, seq_id: int = 0) -> bytearray:
    """A payload of `n_tokens` cells at positions 0, 1, ... whose K and V rows are all zero.

    Deterministic mode's placement pads: nothing attends to them, so only
    where their cells land matters. Built in place (the rows are the zeros of
    a fresh buffer), since a pad of a thousand cells is tens of MiB. Several
    layouts: one section per KV cache, as `parse_sections` reads them.
    """
    if n_tokens < 1:
        raise StateFormatError(f"n_tokens must be at least 1, got {n_tokens}")
    layouts = (layout,) if isinstance(layout, Layout) else tuple(layout)
    # Each section: its header, then as many zero bytes of rows.
    sections: list[tuple[bytes, int]] = []
    for i, one in enumerate(layouts):
        head = _cells_head(one, n_tokens, seq_id, 0)
        sections.append((head if i == 0 else head[_MAGIC_SEQ.size:], 0))
        sections += [(_ROW_HEAD.pack(x.k_type, x.k_row_bytes), n_tokens * x.k_row_bytes) for x in one.layers]
        for x in one.layers:
            v_head = (_TRANS_HEAD.pack(x.v_type, x.v_el_bytes, x.n_embd_v_gqa) if one.v_trans
                      else _ROW_HEAD.pack(x.v_type, x.v_row_bytes))
            sections.append((v_head, n_tokens * x.v_row_bytes))
    out = bytearray(sum(len(head) + rows for head, rows in sections))
    at = 0
    for head, rows in sections:
        out[at : at + len(head)] = head
        at += len(head) + rows
    return out


def _cells_head(layout: Layout, n_tokens: int, seq_id: int, start: int) -> bytes:
    """The payload's header, its cells (positions from `start`, one sequence each) and the layer count."""
    cells = np.empty((n_tokens, 3), "<i4")
    cells[:, 0] = np.arange(start, start + n_tokens)
    cells[:, 1] = 1
    cells[:, 2] = seq_id
    return (_HEAD.pack(IO_MAGIC, seq_id, 1, n_tokens) + cells.tobytes()
            + _U32X2.pack(int(layout.v_trans), layout.n_layer))
