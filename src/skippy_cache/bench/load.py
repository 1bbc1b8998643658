"""A busy machine on demand: processes that keep a core busy while the bench measures.

Model servers share their machine with compilers, test runs and the agents' own tools; a server
that is fast only on an idle machine is fast only in benchmarks. `--background-load 1` keeps core 1
busy for the whole run (every target meets the same load), `any` a process the kernel places, so
`--background-load any` is "one busy process beside the server" and `--background-load 0,1` a busy
process on each of two cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

ANY = "any"
#: A pure-CPU spin that ends by itself once the bench is gone (a killed bench must not leave a
#: core busy forever): it checks its parent between bursts.
_SPIN = (
    "import os, sys\n"
    "parent = int(sys.argv[1])\n"
    "while os.getppid() == parent:\n"
    "    for _ in range(200000): pass\n"
)


@dataclass(frozen=True, slots=True)
class BackgroundLoad:
    """One busy process per entry: a core number it is pinned to, or None (the kernel places it)."""

    cores: tuple[int | None, ...] = ()

    @classmethod
    def parse(cls, text: str) -> BackgroundLoad:
        """`1`, `0,1`, `any` or `any,any`; ValueError naming what is wrong."""
        usable = os.sched_getaffinity(0)
        cores: list[int | None] = []
        for item in (part.strip() for part in text.split(",")):
            if item == ANY:
                cores.append(None)
                continue
            if not item.isdigit():
                raise ValueError(f"--background-load {text!r}: expected core numbers or '{ANY}', e.g. 1 or 0,1")
            if int(item) not in usable:
                raise ValueError(f"--background-load: core {item} is not one this process may use "
                                 f"({', '.join(map(str, sorted(usable)))})")
            cores.append(int(item))
        return cls(tuple(cores))

    def describe(self) -> str:
        if not self.cores:
            return "none"
        names = ", ".join("anywhere" if c is None else f"core {c}" for c in self.cores)
        return f"{len(self.cores)} busy process{'es' if len(self.cores) > 1 else ''} ({names})"

    def to_json(self) -> list[int | str]:
        return [ANY if c is None else c for c in self.cores]


@contextmanager
def background_load(load: BackgroundLoad) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Run `load`'s busy processes for the duration of the block; they stop when it ends."""
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for core in load.cores:
            process = subprocess.Popen([sys.executable, "-c", _SPIN, str(os.getpid())],
                                       stdin=subprocess.DEVNULL)
            processes.append(process)
            if core is not None:
                os.sched_setaffinity(process.pid, {core})
        yield processes
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()
