"""What a model's memory is, and the one rule each kind of memory gives reuse.

llama.cpp keeps four kinds of per-sequence memory, and a cache entry's cells
are exact state for a shorter prefix only in the first:
- attention: every layer keeps a K/V row per position (llama, qwen3). The
  first L cells of an entry are exactly the state of its first L tokens, so
  any leading part of any entry serves (the radix index);
- sliding window (iSWA: gemma 2/3): some layers attend only to the last
  `n_swa` positions, and llama.cpp hands their older cells to whatever
  decodes next. A leading part of an entry serves only while the window
  before its end is still held; the entry's own end always is;
- recurrent (mamba, mamba2): one state per sequence, the state after its last
  token. `seq_cp` ignores the range and copies the latest state, and `seq_rm`
  cannot shorten it: a hit is exact only at an entry's own length;
- hybrid (lfm2, granitehybrid, qwen35, jamba, nemotron-h): attention layers
  and recurrent layers; the recurrent part decides, as above.

Entries of the last three kinds are therefore recorded where the lane is,
at the lengths the cache looks up (the record grid during prefill, where a
system message ends, the whole prompt, the end of a reply): checkpoints, each
a whole state at exactly its length, and stored whole. This module is pure:
the runtime asks llama.cpp what the model is and applies the rule.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from skippy_cache.config import CacheMode, CachePayload


class Memory(str, enum.Enum):
    ATTENTION = "attention"
    SLIDING_WINDOW = "sliding-window"
    RECURRENT = "recurrent"
    HYBRID = "hybrid"


#: Architectures llama.cpp loads but does not run reliably (its own tests hang on RWKV):
#: refused at start, with this reason, rather than served and wedged.
REFUSED = {
    "rwkv6": "RWKV 6",
    "rwkv6qwen2": "RWKV 6 (Qwen 2 hybrid)",
    "rwkv7": "RWKV 7",
    "arwkv7": "RWKV 7 (ARWKV)",
}


@dataclass(frozen=True, slots=True)
class Family:
    """A loaded model's memory, as llama.cpp reports it (`llama_model_is_recurrent`,
    `llama_model_is_hybrid`, `llama_model_n_swa`)."""

    architecture: str
    memory: Memory
    #: The sliding window's width in positions (0: no sliding-window layer).
    n_swa: int = 0

    @classmethod
    def of(cls, architecture: str, *, recurrent: bool, hybrid: bool, n_swa: int) -> Family:
        if hybrid:
            memory = Memory.HYBRID
        elif recurrent:
            memory = Memory.RECURRENT
        elif n_swa > 0:
            memory = Memory.SLIDING_WINDOW
        else:
            memory = Memory.ATTENTION
        return cls(architecture, memory, max(0, n_swa))

    @property
    def any_prefix(self) -> bool:
        """Any leading part of an entry is exact state (attention only)."""
        return self.memory is Memory.ATTENTION

    @property
    def whole_entries(self) -> bool:
        """A hit must end where an entry ends (recurrent state exists only at the entry's length)."""
        return self.memory in (Memory.RECURRENT, Memory.HYBRID)

    @property
    def checkpoints(self) -> bool:
        """Entries are recorded where the lane is, as it passes the lengths the cache looks up."""
        return self.memory is not Memory.ATTENTION

    @property
    def chunked(self) -> bool:
        """The exported state is rows per token that chunks can be cut from and joined again
        (stateformat.py); the store keeps the other kinds' states whole, restorable at their length."""
        return self.memory is Memory.ATTENTION

    def describe(self) -> str:
        """One line for the startup block: the memory and what reuse it gets."""
        if self.memory is Memory.ATTENTION:
            return "attention: any cached prefix is reused; stored as chunks of token rows"
        if self.memory is Memory.SLIDING_WINDOW:
            return (f"sliding-window of {self.n_swa}: a prefix is reused where the window before its end is "
                    "held, else from a checkpoint (an entry ending there); stored as whole states")
        return (f"{self.memory.value}: reused only at checkpoints (the record grid, whole prompts, reply ends), "
                "where the recurrent state was saved; stored as whole states")


def refusal(architecture: str) -> str | None:
    """Why the server will not serve a GGUF of this architecture at all (None: it will), known
    before the model loads."""
    name = REFUSED.get(architecture)
    if name is None:
        return None
    return (f"architecture {architecture!r} ({name}) is not supported: llama.cpp does not run it reliably "
            "(its own tests hang on it); use another model")


def resolve_mode(
    mode: CacheMode, payload: CachePayload, family: Family
) -> tuple[CacheMode, str | None]:
    """The mode the runtime will use and, when it differs from the request, why.

    `auto` is lookup-record for every kind of memory: each kind has its rule.
    Only a payload of KV alone is refused where the model keeps state outside
    the KV cells: reusing it would leave that state behind and give a
    confidently wrong continuation.
    """
    if mode is CacheMode.AUTO:
        mode = CacheMode.LOOKUP_RECORD
    if mode is CacheMode.DISABLED or not family.whole_entries:
        return mode, None
    if payload is CachePayload.RESIDENT_KV:
        return CacheMode.DISABLED, (
            f"cache {mode.value} -> disabled: payload resident-kv leaves a {family.memory.value} model's "
            "recurrent state behind (use payload auto or kv-recurrent)")
    return mode, None
