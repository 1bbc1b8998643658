"""The reply memory (server/replies.py), with no model: bounded, most recently used kept, and
scoped by cache namespace like cached state."""

from __future__ import annotations

from skippy_cache.server.replies import Reply, ReplyMemory


def test_a_reply_is_found_by_its_text_and_by_its_calls_within_its_namespace_only() -> None:
    memory = ReplyMemory()
    reply = Reply("<tool_call>...</tool_call>", (1, 2, 3))
    memory.remember("tenant-a", reply, ("call_1", "call_2"))
    assert memory.by_text("tenant-a", reply.text) == reply
    assert memory.by_call("tenant-a", "call_2") == reply
    assert memory.by_text("tenant-b", reply.text) is None and memory.by_call(None, "call_1") is None


def test_the_least_recently_used_reply_goes_first() -> None:
    memory = ReplyMemory(capacity=2)
    for k in range(2):
        memory.remember(None, Reply(f"reply {k}", (k,)), (f"call_{k}",))
    assert memory.by_text(None, "reply 0") is not None  # used: now the most recent
    memory.remember(None, Reply("reply 2", (2,)), ("call_2",))
    assert memory.by_text(None, "reply 1") is None and memory.by_call(None, "call_1") is None
    assert memory.by_text(None, "reply 0") is not None and len(memory) == 2


def test_an_empty_reply_is_not_kept() -> None:
    memory = ReplyMemory()
    memory.remember(None, Reply("", ()))
    memory.remember(None, Reply("text", ()))
    assert len(memory) == 0
