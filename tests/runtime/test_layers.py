"""Layers import one way only: server -> runtime -> core."""

from __future__ import annotations

import ast
from pathlib import Path

import skippy_cache

PACKAGE = Path(skippy_cache.__file__).parent


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_runtime_never_imports_the_server():
    for path in (PACKAGE / "runtime").glob("*.py"):
        offending = {m for m in imported_modules(path) if m.startswith("skippy_cache.server")}
        assert not offending, f"{path.name} imports {offending}"


def test_only_native_py_touches_llama_cpp():
    for path in (PACKAGE / "runtime").glob("*.py"):
        uses = {m for m in imported_modules(path) if m.split(".")[0] == "llama_cpp"}
        if path.name != "native.py":
            assert not uses, f"{path.name} imports {uses}: llama.cpp calls belong in native.py"


def test_server_reaches_llama_cpp_only_through_the_runtime():
    for path in (PACKAGE / "server").glob("*.py"):
        uses = {m for m in imported_modules(path) if m.split(".")[0] == "llama_cpp"}
        assert not uses, f"{path.name} imports {uses}"
