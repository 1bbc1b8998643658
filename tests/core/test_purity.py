"""The core imports nothing from llama.cpp, the network, threads, the runtime or the server."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import skippy_cache

PACKAGE_DIR = Path(skippy_cache.__file__).resolve().parent
SRC = PACKAGE_DIR.parent

# Every top-level module is core: the runtime and the server live in subpackages.
# `__main__` is the CLI, which reaches the runtime and server lazily.
CORE_MODULES = ["skippy_cache"] + sorted(
    f"skippy_cache.{path.stem}" for path in PACKAGE_DIR.glob("*.py") if path.stem not in {"__init__", "__main__"}
)
# The replay runs the core alone (its command line reaches the runtime lazily, for a model's figures).
REPLAY_MODULES = ["skippy_cache.sizing.trace", "skippy_cache.sizing.replay"]

# Checked at run time in sys.modules. Neither blake3 nor the stdlib modules the
# core uses load `threading` (checked on CPython 3.11); if a future stdlib does,
# drop it from this list: the source check below still covers the core's own imports.
FORBIDDEN_LOADED = [
    "llama_cpp",
    "threading",
    "socket",
    "asyncio",
    "fastapi",
    "uvicorn",
    "starlette",
    "skippy_cache.runtime",
    "skippy_cache.server",
]

# Checked in the source: the roots nothing in the core may import.
FORBIDDEN_IMPORTS = {"threading", "socket", "asyncio", "llama_cpp", "fastapi", "uvicorn", "starlette"}
FORBIDDEN_PACKAGES = {"skippy_cache.runtime", "skippy_cache.server"}


@pytest.mark.parametrize("module", CORE_MODULES + REPLAY_MODULES)
def test_importing_the_core_loads_nothing_forbidden(module: str) -> None:
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps(sorted(n for n in {FORBIDDEN_LOADED!r} if n in sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [], f"importing {module} loaded {out.stdout.strip()}"


def test_the_check_would_catch_a_forbidden_import() -> None:
    # Guards the test above against vacuity: asyncio does show up when imported.
    code = f"import asyncio, sys; print([n for n in {FORBIDDEN_LOADED!r} if n in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "asyncio" in out.stdout


def _imported_names(path: Path) -> set[str]:
    """Absolute module names a source file imports (relative imports resolved against the package)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = "skippy_cache" + (f".{node.module}" if node.module else "")
                names.add(base)
                names.update(f"{base}.{alias.name}" for alias in node.names)
            elif node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in {
            "__import__",
            "import_module",
        }:
            literal = [a.value for a in node.args if isinstance(a, ast.Constant)]
            names.update(v for v in literal if isinstance(v, str))
    return names


def _forbidden(names: set[str]) -> set[str]:
    bad = set()
    for name in names:
        if name.split(".")[0] in FORBIDDEN_IMPORTS:
            bad.add(name)
        if any(name == pkg or name.startswith(pkg + ".") for pkg in FORBIDDEN_PACKAGES):
            bad.add(name)
    return bad


@pytest.mark.parametrize("module", CORE_MODULES + REPLAY_MODULES)
def test_core_source_imports_nothing_forbidden(module: str) -> None:
    relative = module.split(".")[1:]
    path = PACKAGE_DIR.joinpath(*relative).with_suffix(".py") if relative else PACKAGE_DIR / "__init__.py"
    assert path.is_file(), path
    assert _forbidden(_imported_names(path)) == set()


def test_source_check_catches_forbidden_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import threading\n"
        "from socket import socket\n"
        "from skippy_cache.runtime import engine\n"
        "from .server import app\n"
        "import importlib\n"
        "importlib.import_module('llama_cpp')\n"
        "from skippy_cache import runtime\n"
    )
    assert _forbidden(_imported_names(sample)) == {
        "threading",
        "socket",
        "socket.socket",
        "skippy_cache.runtime",
        "skippy_cache.runtime.engine",
        "skippy_cache.server",
        "skippy_cache.server.app",
        "llama_cpp",
    }
