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


#: What the server may use of an `Engine`: its public API, nothing of its collaborators.
ENGINE_API = {"info", "stats", "submit", "tokenize", "detokenize", "alive", "close", "clear_cache", "validate",
              "generate", "explain", "unpin", "pool_view", "pool_audit", "clear_tenant", "tenant_figures",
              "control_texts"}


def test_server_uses_only_the_runtime_packages_public_api():
    import skippy_cache.runtime as runtime

    public = set(runtime.__all__)
    for path in (PACKAGE / "server").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("skippy_cache.runtime"):
                assert node.module == "skippy_cache.runtime", (
                    f"{path.name} imports from {node.module}: import from skippy_cache.runtime (its __all__)"
                )
                names = {alias.name for alias in node.names}
                assert names <= public, f"{path.name} imports {names - public}, not in skippy_cache.runtime.__all__"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("skippy_cache.runtime") for a in node.names), path.name


def test_server_reads_no_engine_internals():
    for path in (PACKAGE / "server").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and _names_engine(node.value):
                assert node.attr in ENGINE_API, f"{path.name}:{node.lineno} reads engine.{node.attr}"


def _names_engine(node: ast.expr) -> bool:
    """`engine` or `self.engine`."""
    if isinstance(node, ast.Name):
        return node.id == "engine"
    return isinstance(node, ast.Attribute) and node.attr == "engine"
