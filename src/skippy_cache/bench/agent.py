"""The agent workload: coding agents that share one system prompt and tool list, step by step.

What a prefix cache exists for. Every agent sends the same long system prompt and the same tool
schemas on every step, then its own growing history: each step's call, then the tool's result.
The run sends it through chat completions (`tool_choice` required) and through Anthropic's
Messages API (`tool_choice` any, with Claude Code's billing line, whose checksum changes on every
request, first in the system prompt) to every target that speaks the API.

Agent 1 takes its first step alone; the others start together once it is answered, so their
first steps find the shared prefix computed (skippy-cache computes it once; a server that caches
per slot computes it again for each). Each agent then steps on as soon as its last step is
answered. The groups: "<api> step 1, agent 1", "<api> step 1, agents 2+", "<api> step k".
Every prompt depends only on the run's seed: every target gets the same first step, and later
steps differ only by what each server's model answered.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from skippy_cache.bench.client import MESSAGES, Reply
from skippy_cache.bench.run import Run
from skippy_cache.bench.targets import Target
from skippy_cache.bench.text import passage, words_for

CHAT = "/v1/chat/completions"
#: The APIs the agents speak, in the order they run; a server lacking one is skipped for it.
APIS = ("chat", "messages")
#: Servers without Anthropic's Messages API.
NO_MESSAGES = ("llama-cpp-python",)


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


_STR = {"type": "string"}
#: A coding agent's tools, with the kind of schemas real agents send (descriptions, enums, nesting).
TOOLS: list[dict[str, Any]] = [
    {"name": "read_file", "description": "Read a file of the repository. Returns its text with line numbers.",
     "parameters": _object({"path": {**_STR, "description": "Path from the repository root"},
                            "start_line": {"type": "integer", "minimum": 1},
                            "end_line": {"type": "integer", "minimum": 1}}, ["path"])},
    {"name": "write_file", "description": "Create or overwrite a file with the given content.",
     "parameters": _object({"path": _STR, "content": _STR}, ["path", "content"])},
    {"name": "edit_file", "description": "Replace one exact occurrence of a string in a file.",
     "parameters": _object({"path": _STR, "old": {**_STR, "description": "Text to find, exactly once"},
                            "new": _STR}, ["path", "old", "new"])},
    {"name": "list_directory", "description": "List the entries of a directory, optionally recursively.",
     "parameters": _object({"path": _STR, "recursive": {"type": "boolean"},
                            "max_entries": {"type": "integer", "minimum": 1, "maximum": 1000}}, ["path"])},
    {"name": "search_code", "description": "Search the repository for a regular expression.",
     "parameters": _object({"pattern": _STR, "glob": {**_STR, "description": "Only files matching this glob"},
                            "case_sensitive": {"type": "boolean"}}, ["pattern"])},
    {"name": "run_command", "description": "Run a shell command in the repository and return its output.",
     "parameters": _object({"command": _STR, "timeout_s": {"type": "integer", "minimum": 1, "maximum": 600},
                            "env": {"type": "object", "additionalProperties": _STR}}, ["command"])},
    {"name": "run_tests", "description": "Run the test suite or a part of it.",
     "parameters": _object({"paths": {"type": "array", "items": _STR},
                            "filter": {**_STR, "description": "Only tests whose name matches"},
                            "fail_fast": {"type": "boolean"}}, [])},
    {"name": "git", "description": "Run a read-only git command: status, diff, log or show.",
     "parameters": _object({"subcommand": {"type": "string", "enum": ["status", "diff", "log", "show"]},
                            "args": {"type": "array", "items": _STR}}, ["subcommand"])},
    {"name": "web_fetch", "description": "Fetch a URL and return its text, converted from HTML.",
     "parameters": _object({"url": _STR, "max_chars": {"type": "integer", "minimum": 100}}, ["url"])},
    {"name": "create_issue", "description": "File an issue in the project's tracker.",
     "parameters": _object({"title": _STR, "body": _STR,
                            "labels": {"type": "array", "items": {"type": "string",
                                                                  "enum": ["bug", "feature", "docs", "test"]}},
                            "priority": {"type": "string", "enum": ["low", "normal", "high"]}},
                           ["title", "body"])},
]
CHAT_TOOLS = [{"type": "function", "function": tool} for tool in TOOLS]
MESSAGES_TOOLS = [{"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
                  for t in TOOLS]
#: The tools' share of the shared prompt, in tokens per character of their JSON (a rough aim:
#: the system passage is sized so that instructions and tools make about `agent_system_tokens`).
_TOKENS_PER_JSON_CHAR = 0.3


def _billing_line(run: Run, agent: int, step: int) -> str:
    """Claude Code's first system block: its `cch` checksum differs on every request."""
    cch = random.Random(f"{run.seed}:cch:{agent}:{step}").getrandbits(20)
    return f"x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch={cch:05x};"


class _Agent:
    """Agent a of a run on one API: its task and the history it resends on every step."""

    def __init__(self, run: Run, a: int, api: str, system: str) -> None:
        self.a = a
        self.api = api
        self.system = system
        task = passage(f"{run.seed}:agent-task:{a}", 24).rstrip(".")
        user = f"Task: {task}. Use the tools, one call at a time."
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": user}]
        if api == "chat":
            self.messages.insert(0, {"role": "system", "content": system})

    def body(self, run: Run, step: int) -> dict[str, Any]:
        s = run.sizes
        if self.api == "chat":
            return {"messages": list(self.messages), "tools": CHAT_TOOLS, "tool_choice": "required",
                    "max_tokens": s.agent_max_tokens, "temperature": 0}
        system = [{"type": "text", "text": _billing_line(run, self.a, step)}, {"type": "text", "text": self.system}]
        return {"system": system, "messages": list(self.messages), "tools": MESSAGES_TOOLS,
                "tool_choice": {"type": "any"}, "max_tokens": s.agent_max_tokens, "temperature": 0}

    def answered(self, run: Run, step: int, reply: Reply) -> None:
        """The reply and the tools' results join the history (a reply without a call gets the
        result as a user turn, so every step grows the history alike)."""
        s = run.sizes
        rng = random.Random(f"{run.seed}:agent-result:{self.a}:{step}")
        size = rng.randint(*s.agent_result_tokens)
        result = passage(f"{run.seed}:agent-result:{self.a}:{step}", words_for(size, run.tokens_per_word))
        calls = reply.calls if reply.ok else ()
        if not calls:
            self.messages += [{"role": "assistant", "content": reply.text if reply.ok and reply.text else "(no reply)"},
                              {"role": "user", "content": f"Tool output:\n{result}"}]
            return
        if self.api == "chat":
            self.messages.append({"role": "assistant", "content": reply.text or None, "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls]})
            self.messages += [{"role": "tool", "tool_call_id": c.id, "content": result} for c in calls]
            return
        blocks: list[dict[str, Any]] = [{"type": "text", "text": reply.text}] if reply.text else []
        blocks += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)} for c in calls]
        self.messages += [{"role": "assistant", "content": blocks},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id,
                                                        "content": result} for c in calls]}]

    async def step(self, run: Run, target: Target, step: int, group: str) -> None:
        path = CHAT if self.api == "chat" else MESSAGES
        reply = await run.request("agent", target, group, path, self.body(run, step), index=self.a)
        self.answered(run, step, reply)


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def shared_system(run: Run) -> str:
    """The system prompt every agent shares: instructions sized so that they and the tools make
    about `agent_system_tokens`."""
    tools_tokens = int(len(json.dumps(CHAT_TOOLS)) * _TOKENS_PER_JSON_CHAR)
    words = words_for(max(run.sizes.agent_system_tokens - tools_tokens, 50), run.tokens_per_word)
    return "You are a coding agent working in a repository. " + passage(f"{run.seed}:agent-system", words)


def speaks(target: Target, api: str) -> bool:
    return api == "chat" or target.kind not in NO_MESSAGES


async def agents_on(run: Run, target: Target, api: str) -> None:
    """All agents on one target through one API; the groups are prefixed with the API."""
    s = run.sizes
    system = shared_system(run)
    agents = [_Agent(run, a, api, system) for a in range(s.agents)]
    started = time.perf_counter()
    await agents[0].step(run, target, 0, f"{api} step 1, agent 1")

    async def go(agent: _Agent) -> None:
        for step in range(1 if agent.a == 0 else 0, s.agent_steps):
            group = f"{api} step 1, agents 2+" if step == 0 else f"{api} step {step + 1}"
            await agent.step(run, target, step, group)

    await asyncio.gather(*(go(agent) for agent in agents))
    run.span("agent", target, f"{api} all steps", started, s.agents * s.agent_steps)


async def agent(run: Run) -> None:
    for api in APIS:
        for target in run.targets_for("agent"):
            if speaks(target, api):
                await agents_on(run, target, api)


def planned_pairs(targets: list[Target]) -> int:
    """How many (target, API) runs the workload makes: the progress bar's `n_targets`."""
    return sum(speaks(target, api) for api in APIS for target in targets)
