"""Recent replies as they were generated, so the next turn resends the very tokens the cache holds.

A reply's cached state is its prompt's tokens plus the tokens the model
sampled. The next turn sends the reply back as text, and tokenizing that text
need not give the sampled tokens: a grammar lets the model spell `{"` as `{`
then `"`, which the tokenizer merges; a client turns an Anthropic `tool_use`
block's `input` back into JSON with its own spacing. Either way the prompt
parts from the cached entry inside the reply, and everything after it is
prefilled again, on every step of an agent.

So the server remembers each reply it returned, by its text and by the ids of
the calls in it, and a later prompt that resends it gets the sampled tokens in
its place. Nothing here is cache state: the tokens are the model's own, they
decode to the same text, and a cold run of the same history renders them the
same way (cache on or off, `lookup` or not), so reuse stays exact. A reply the
memory has forgotten (evicted, another replica, a restart) is tokenized from
text as before: only reuse is lost, never correctness.

Entries are scoped by cache namespace (`cache_salt`), like cached state: one
tenant's prompt is never tokenized by what another tenant was answered.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

#: Replies remembered; a few hundred agents' latest steps (an entry is its text and token ids).
DEFAULT_CAPACITY = 4096


@dataclass(frozen=True, slots=True)
class Reply:
    """A generated reply: its text and the tokens sampled for it (which decode to that text)."""

    text: str
    tokens: tuple[int, ...]


class ReplyMemory:
    """A bounded LRU of generated replies, found by (namespace, text) or (namespace, call id).

    Thread-safe: replies are remembered on the event loop and recalled while a
    prompt is tokenized on a worker thread.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        #: (namespace, text) -> the reply and the ids of its calls, least recently used first.
        self._replies: OrderedDict[tuple[str | None, str], tuple[Reply, tuple[str, ...]]] = OrderedDict()
        #: (namespace, call id) -> the key of the reply that made the call.
        self._calls: dict[tuple[str | None, str], tuple[str | None, str]] = {}
        self._lock = threading.Lock()

    def remember(self, namespace: str | None, reply: Reply, call_ids: tuple[str, ...] = ()) -> None:
        if not reply.text or not reply.tokens:
            return
        key = (namespace, reply.text)
        with self._lock:
            self._replies[key] = (reply, call_ids)
            self._replies.move_to_end(key)
            for call_id in call_ids:
                self._calls[(namespace, call_id)] = key
            while len(self._replies) > self.capacity:
                (old_namespace, _), (_, old_calls) = self._replies.popitem(last=False)
                for call_id in old_calls:
                    self._calls.pop((old_namespace, call_id), None)

    def by_text(self, namespace: str | None, text: str) -> Reply | None:
        with self._lock:
            return self._use((namespace, text))

    def by_call(self, namespace: str | None, call_id: str) -> Reply | None:
        with self._lock:
            key = self._calls.get((namespace, call_id))
            return self._use(key) if key is not None else None

    def forget(self, wanted: Callable[[str | None], bool]) -> int:
        """Drop the replies of every namespace `wanted` picks (a cache cleared); how many went."""
        with self._lock:
            gone = [key for key in self._replies if wanted(key[0])]
            for key in gone:
                _, calls = self._replies.pop(key)
                for call_id in calls:
                    self._calls.pop((key[0], call_id), None)
            return len(gone)

    def __len__(self) -> int:
        with self._lock:
            return len(self._replies)

    def _use(self, key: tuple[str | None, str]) -> Reply | None:
        entry = self._replies.get(key)
        if entry is None:
            return None
        self._replies.move_to_end(key)
        return entry[0]
