"""llama.cpp's own `llama-server` as a peer: find the binary, or build the one skippy-cache runs on.

The binary is looked up in this order: `--llama-server PATH`, `$LLAMA_SERVER`, `llama-server` on
PATH. Failing all three, it is built from the llama.cpp that the pinned llama-cpp-python sdist
vendors (the same llama.cpp skippy-cache runs, so the comparison is kernel for kernel) into
`<out>/peers/`, and kept there for the next run. The build needs cmake and a C++ compiler and takes
about 8 minutes on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

from rich.console import Console

ENV = "LLAMA_SERVER"


class LlamaServerError(RuntimeError):
    pass


def find_llama_server(explicit: Path | None, out_dir: Path, console: Console) -> Path:
    """The llama-server binary to run, building it if there is none."""
    for candidate in (explicit, os.environ.get(ENV), shutil.which("llama-server")):
        if candidate:
            path = Path(candidate)
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise LlamaServerError(f"llama-server {path} is not an executable file")
            return path
    return build_llama_server(out_dir / "peers", console)


def build_llama_server(dest: Path, console: Console) -> Path:
    """Build llama-server from the vendored llama.cpp of the installed llama-cpp-python (cached in `dest`)."""
    version = metadata.version("llama-cpp-python")
    dest.mkdir(parents=True, exist_ok=True)
    binary = dest / f"llama-server-{version}"
    if binary.is_file():
        return binary
    if shutil.which("cmake") is None:
        raise LlamaServerError("building llama-server needs cmake (apt-get install cmake), or pass --llama-server PATH")
    console.print(f"building llama-server from llama-cpp-python {version}'s llama.cpp in {dest} (about 8 minutes)")
    sdist = dest / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={version}", "-d", str(dest)], dest)
    source = dest / f"llama_cpp_python-{version}"
    if not source.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(dest, filter="data")
    llama_cpp = source / "vendor" / "llama.cpp"
    # Static: the binary is copied out of the build tree, away from the shared libraries.
    _run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
          "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], llama_cpp)
    _run(["cmake", "--build", "build", "--target", "llama-server", "-j", str(os.cpu_count() or 1)], llama_cpp)
    shutil.copy2(llama_cpp / "build" / "bin" / "llama-server", binary)
    return binary


def _run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise LlamaServerError(f"{' '.join(command[:3])}... failed ({done.returncode}):\n{tail}")
