"""Deterministic mode's kernels: which kernel computes each row of a prompt, and which hits are exact.

On llama.cpp's CPU flash-attention kernel a row's floats depend on the kernel
that computed it (placement.py keeps the cells where each kernel needs them):
- a step of 64 rows or more runs the tiled kernel;
- a step of fewer rows computes each row on its own.

Deterministic mode fixes each row's kernel from the request alone, so that a
cold run and any warm run compute every row alike. Rows are computed row by
row from the prompt's last 64-token block boundary on (its last partial block,
its last token, and every generated token), and over each earlier reply the
prompt resends (a chat's history: the block where the previous turn's prompt
ended, up to the next block boundary after the reply), because those rows were
computed one at a time when the reply was generated. Every other row is
computed in tiled steps of whole blocks.

A request's kernels are `Kernels`: the positions where row-by-row spans start
and end, all on the block grid, the last one open. A cached entry's first L
cells serve a prompt exactly when every one of them was computed by the kernel
the prompt's own cold run would use, and the prompt can resume there the way
its cold run went on: a tiled chunk starts on a block boundary.

State that leaves the process (the store's chunks on disk and in the shared
tier, found by name) carries in its name the bounds that decide the kernels
of its rows (`rows_key`): a chunk's name then matches only a prompt that
computes every one of those rows alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from skippy_cache.identity import IdentityKey
from skippy_cache.placement import ALIGN


@dataclass(frozen=True, slots=True)
class Kernels:
    """Where a prompt's rows switch kernel: row by row from `bounds[0]`, tiled again from `bounds[1]`,
    row by row from `bounds[2]`, and so on; tiled before `bounds[0]`; the last span never ends.

    Every bound is on the 64-token block grid, they strictly increase, and
    there is an odd number of them: the last span is open.
    """

    bounds: tuple[int, ...]

    def row_by_row(self, pos: int) -> bool:
        """Whether the row at `pos` is computed on its own (not tiled)."""
        return sum(1 for b in self.bounds if b <= pos) % 2 == 1

    def span_end(self, pos: int, end: int) -> int:
        """Where the run of rows computed by the kernel of the row at `pos` ends, at most `end`."""
        return next((b for b in self.bounds if pos < b < end), end)

    def before(self, end: int) -> tuple[int, ...]:
        """The bounds that decide the kernels of rows [0, end): prompts with equal ones compute those rows alike."""
        return tuple(b for b in self.bounds if b < end)


def rows_key(space: IdentityKey, bounds: tuple[int, ...]) -> IdentityKey:
    """The identity key of state whose rows were computed with these kernel bounds (`Kernels.before`).

    Never equal to `space` itself: state computed in fast mode, by whatever
    kernels, never shares a name with state computed in deterministic mode.
    """
    return replace(space, extra=space.extra + (("rows", ",".join(map(str, bounds))),))


def kernels(prefill_end: int, replies: Iterable[tuple[int, int]] = ()) -> Kernels:
    """The kernels of a prompt that prefills `prefill_end` positions and resends earlier `replies`.

    A reply `(start, end)` occupies positions [start, end): `start` is the
    length of the prompt that generated it. Its span starts at that prompt's
    last block boundary and ends at the first block boundary past the reply.
    """
    spans = sorted((_floor(start - 1), _ceil(end)) for start, end in replies if 0 < start <= end <= prefill_end)
    last = _floor(prefill_end)
    bounds: list[int] = []
    for lo, hi in spans:
        if lo >= last:
            break
        hi = min(hi, last)
        if bounds and lo <= bounds[-1]:
            bounds[-1] = max(bounds[-1], hi)  # overlapping or touching: one span
        else:
            bounds += [lo, hi]
    if bounds and bounds[-1] >= last:
        bounds.pop()  # the last reply's span runs into the open one
    else:
        bounds.append(last)
    return Kernels(tuple(bounds))


def exact_length(length: int, entry: Kernels, prompt: Kernels) -> int:
    """How many of the `length` tokens an entry shares with a prompt the prompt may reuse exactly.

    `entry` are the kernels of the prompt that computed the entry (its reply,
    if recorded, was computed row by row past them).
    """
    differs = set(entry.bounds) ^ set(prompt.bounds)
    # Both start tiled: the kernels agree up to the first bound only one of them has.
    n = min(length, min(differs, default=length))
    if not prompt.row_by_row(n):
        n = _floor(n)  # a tiled chunk resumes on a block boundary
    return n


def _floor(n: int) -> int:
    return n - n % ALIGN


def _ceil(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
