"""Deterministic mode's hit rule: how many leading cells of an entry a prompt may reuse bit for bit.

On llama.cpp's CPU flash-attention kernel a row's floats depend on the kernel
that computed it (placement.py keeps the cells where each kernel needs them):
- a step of 64 rows or more runs the tiled kernel;
- a step of fewer rows computes each row on its own.

Deterministic mode prefills a prompt's whole 64-token blocks in tiled steps and
everything after its last block boundary row by row: the prompt's last partial
block in a step of its own, the last prompt token, and every generated token.
So each row's kernel is a function of the prompt alone: tiled below its
*tiled end* (`tiled_end`), row by row from there on.

A cached entry's first L cells serve a prompt exactly when every one of them
was computed by the kernel the prompt's own cold run would use, and the prompt
can resume there the way its cold run went on: a tiled chunk starts on a block
boundary, so a resume below the prompt's tiled end must be one. Where the two
tiled ends differ, the rows between them were computed by the other kernel, so
the hit stops at the lower one.
"""

from __future__ import annotations

from skippy_cache.placement import ALIGN


def tiled_end(prefill_end: int) -> int:
    """Where a prompt's tiled rows end: its last 64-token block boundary at or before `prefill_end`
    (the positions prefilled before the last prompt token)."""
    return prefill_end - prefill_end % ALIGN


def exact_length(length: int, entry_tiled_end: int, prompt_tiled_end: int) -> int:
    """How many of the `length` tokens an entry shares with a prompt the prompt may reuse exactly.

    `entry_tiled_end` is the tiled end of the prompt that computed the entry
    (its reply, if recorded, was computed row by row after it).
    """
    if entry_tiled_end == prompt_tiled_end and length >= prompt_tiled_end:
        return length
    reusable = min(length, entry_tiled_end, prompt_tiled_end)
    return reusable - reusable % ALIGN
