"""Traces in Mooncake's format, and the synthetic prompts a replay builds from them.

One JSON object per line: `timestamp` (ms), `input_length` and
`output_length` (tokens), `hash_ids` (one id per block of `block_tokens`
tokens, the last block possibly partial; two requests share their first k ids
exactly when their prompts share their first k blocks), and optionally
`tenant` (`serve --trace-log` writes it). This is what Mooncake's FAST'25
traces, NVIDIA Dynamo's replay and aiperf's `mooncake_trace` read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: Tokens per block in Mooncake's traces and in `serve --trace-log`.
BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that is not a request, named by file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    #: Milliseconds from the trace's start.
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tenant: str | None = None

    @property
    def seconds(self) -> float:
        return self.timestamp / 1000


def read_trace(path: Path, block_tokens: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """Every request of a trace file, in file order; `TraceError` names the first bad line."""
    try:
        with path.open() as f:
            return list(parse_trace(f, block_tokens, name=str(path)))
    except OSError as exc:
        raise TraceError(f"{path}: cannot read it ({exc.strerror or exc})") from None


def parse_trace(
    lines: Iterable[str], block_tokens: int = BLOCK_TOKENS, *, name: str = "trace"
) -> Iterator[TraceRequest]:
    """The requests of a trace's lines, in order; `TraceError` names the first bad line."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield _request(json.loads(line), block_tokens)
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceError(f"{name}:{number}: not a trace request ({exc}); expected "
                             '{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}') from None


def _request(obj: dict[str, object], block_tokens: int) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TypeError("a line must be a JSON object")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TypeError("hash_ids must be a list of integers")
    n = obj["input_length"]
    out = obj.get("output_length", 0)
    ts = obj["timestamp"]
    if not isinstance(n, int) or not isinstance(out, int) or not isinstance(ts, int | float):
        raise TypeError("timestamp, input_length and output_length must be numbers")
    if n <= 0 or out < 0 or ts < 0:
        raise ValueError("input_length must be positive, output_length and timestamp not negative")
    blocks = -(-n // block_tokens)
    if len(ids) != blocks:
        raise ValueError(f"{n} input tokens make {blocks} blocks of {block_tokens}, but there are {len(ids)} "
                         "hash_ids (pass the trace's --block-tokens)")
    tenant = obj.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise TypeError("tenant must be a string")
    return TraceRequest(float(ts), n, out, tuple(ids), tenant)


@dataclass(slots=True)
class SyntheticTokens:
    """Token ids for a trace's blocks: block `h` is a run of ids no other block uses.

    Hash ids may be any integers (a trace log's are 63-bit): each is given a
    dense number on first sight, so tokens stay int32 whatever the ids. A
    partial last block is the first tokens of its block, so a prompt whose
    last block is cut shorter is a prefix of one that is not.
    """

    block_tokens: int = BLOCK_TOKENS
    _numbers: dict[int, int] = field(default_factory=dict)

    def prompt(self, request: TraceRequest) -> list[int]:
        b = self.block_tokens
        tokens: list[int] = []
        for h in request.hash_ids:
            start = self._numbers.setdefault(h, len(self._numbers)) * b
            tokens.extend(range(start, start + b))
        del tokens[request.input_length:]
        return tokens
