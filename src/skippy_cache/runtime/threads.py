"""How many threads llama.cpp computes with: the cores this process may use, and of those the
ones the rest of the machine leaves free, step by step.

ggml's CPU backend (built with OpenMP, as llama-cpp-python builds it on Linux) ends every op of a
graph at a team barrier, where libgomp's threads spin for a while before they sleep. Alone on a
machine that is the fastest way to wait. Beside a compiler or a test run it is a collapse: a
thread that spins holds a core that the thread it waits for needs, so each of a graph's hundreds
of barriers can cost a scheduler time slice. Sleeping at once (`OMP_WAIT_POLICY=PASSIVE`) avoids
that but pays a wake-up at every barrier, dear on a virtual machine even when the machine is idle
(benchmark history, 2026-12-07). So the team is sized instead: `ThreadGovernor` reads, twice a
second, how much of this process's CPUs other processes used, and each step runs on the cores
they left free (a team of one has no barrier at all). The thread count moves no float: every row
exact mode computes is computed by one thread whatever the team's size
(`test_the_team_size_moves_no_float_so_hits_survive_a_change_of_threads`).

The cores this process may use are its affinity mask and a cgroup CPU quota (a container's
`--cpus`), which `os.cpu_count()` ignores. A team larger than the quota is throttled in the middle
of a graph, with every thread of the team waiting at the next barrier.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
#: libgomp's own knob: rounds a thread spins at a barrier before it sleeps (default 300,000).
SPIN_COUNT_ENV = "GOMP_SPINCOUNT"
#: How often the governor reads the machine's CPU time; a load that starts costs at most this long.
SAMPLE_INTERVAL_S = 0.5
#: A core counts as free when other processes leave at least 75% of it.
FREE_CORE_SLACK = 0.25


def wait_policy() -> str:
    """How OpenMP threads wait at barriers in this process (for the start-up block)."""
    policy, spins = os.environ.get(WAIT_POLICY_ENV), os.environ.get(SPIN_COUNT_ENV)
    given = [f"{name}={value}" for name, value in ((WAIT_POLICY_ENV, policy), (SPIN_COUNT_ENV, spins)) if value]
    if not given:
        return (f"OpenMP threads spin, then sleep, at barriers (libgomp's default; {WAIT_POLICY_ENV} or "
                f"{SPIN_COUNT_ENV} change it)")
    return f"OpenMP threads wait at barriers as the environment says ({', '.join(given)})"


@dataclass(frozen=True, slots=True)
class CpuBudget:
    """The cores this process may use."""

    #: The CPUs in the affinity mask (`taskset`, a cpuset cgroup).
    cpus: frozenset[int]
    #: The tightest cgroup CPU quota on the way to the root, in cores (None: none).
    quota: float | None

    @property
    def affinity(self) -> int:
        return len(self.cpus)

    @property
    def threads(self) -> int:
        """llama.cpp threads: the affinity's cores, capped by the quota rounded down (at least 1).

        Down, not up: the server's other threads (the event loop, tokenization, the store's
        writer) draw on the same quota, and a team that spends all of it is throttled mid-graph.
        """
        if self.quota is None:
            return max(1, self.affinity)
        return max(1, min(self.affinity, math.floor(self.quota + 1e-9)))

    def describe(self) -> str:
        quota = "none" if self.quota is None else f"{self.quota:g} CPUs"
        return f"affinity {self.affinity} CPUs, cgroup quota {quota}"


def cpu_budget(root: Path = Path("/")) -> CpuBudget:
    """The budget of the calling process; `root` stands for `/` (tests build a fake tree)."""
    return CpuBudget(cpus=_affinity(), quota=cgroup_quota(root))


def _affinity() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return frozenset(range(os.cpu_count() or 1))


def cgroup_quota(root: Path = Path("/")) -> float | None:
    """The tightest CPU quota, in cores, of this process's cgroup and its ancestors (v1 or v2).

    A quota may be set on any ancestor (a pod's limit sits above its containers'), so every level
    from the process's cgroup up to the mount is read, as the JVM and Go's runtime do.
    """
    try:
        cgroups = (root / "proc/self/cgroup").read_text()
        mounts = (root / "proc/self/mountinfo").read_text()
    except OSError:
        return None
    limits = [q for d in _cpu_dirs(cgroups, mounts, root) for q in _quotas_up(d[0], d[1])]
    return min(limits) if limits else None


def _cpu_dirs(cgroups: str, mounts: str, root: Path) -> list[tuple[Path, Path]]:
    """(the process's cgroup directory, its mount point) for the v1 cpu controller and for v2."""
    paths: dict[str, str] = {}
    for line in cgroups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if parts[0] == "0" and controllers == "":
            paths["v2"] = path
        elif "cpu" in controllers.split(","):
            paths["v1"] = path
    out = []
    for line in mounts.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3:
            continue
        fstype, options = rest[0], rest[2].split(",")
        version = "v2" if fstype == "cgroup2" else "v1" if fstype == "cgroup" and "cpu" in options else None
        if version is None or version not in paths:
            continue
        mount_root, mount_point = fields[3], fields[4]
        path = paths[version]
        # In a container the mount's root is the container's own cgroup: strip it from the path.
        if mount_root != "/" and (path == mount_root or path.startswith(mount_root + "/")):
            path = path[len(mount_root):]
        elif mount_root != "/":
            continue
        point = root / mount_point.lstrip("/")
        out.append((point / path.lstrip("/"), point))
    return out


def _quotas_up(directory: Path, top: Path) -> list[float]:
    out = []
    current = directory
    while True:
        quota = _read_quota(current)
        if quota is not None:
            out.append(quota)
        if current == top or top not in current.parents:
            return out
        current = current.parent


def _read_quota(directory: Path) -> float | None:
    """v2 `cpu.max` ("150000 100000", or "max 100000"), else v1 `cpu.cfs_quota_us` (-1: none)."""
    try:
        quota, _, period = (directory / "cpu.max").read_text().partition(" ")
        if quota.strip() == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        pass
    try:
        quota_us = int((directory / "cpu.cfs_quota_us").read_text())
        period_us = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def threads_for(most: int, cores: int, others: float) -> int:
    """The team for the next steps: the `cores` that other processes, using `others` cores' worth of
    them, leave free (a core counts when at least 75% of it is), between 1 and `most`."""
    return max(1, min(most, math.floor(cores - others + FREE_CORE_SLACK)))


@dataclass(frozen=True, slots=True)
class CpuSample:
    """CPU seconds since boot: busy on the process's CPUs (anyone's), and the process's own."""

    busy_s: float
    own_s: float
    at: float


_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def read_sample(cpus: frozenset[int], root: Path = Path("/")) -> CpuSample | None:
    """From /proc/stat's per-CPU lines and /proc/self/stat; None where they cannot be read."""
    try:
        stat = (root / "proc/stat").read_text()
        own = (root / "proc/self/stat").read_text()
    except OSError:
        return None
    busy = 0
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal ...: busy is all but idle, iowait and steal
        # (time the hypervisor gave to another machine is no process's here).
        fields = [int(x) for x in rest.split()]
        busy += sum(fields[:3]) + sum(fields[5:7])
    # The command name (field 2) may hold spaces: count fields after its closing parenthesis.
    after = own[own.rindex(")") + 2:].split()
    own_ticks = int(after[11]) + int(after[12])  # utime, stime (fields 14 and 15)
    return CpuSample(busy * _TICK_S, own_ticks * _TICK_S, time.monotonic())


class ThreadGovernor:
    """Sizes llama.cpp's team between steps from what other processes use of this process's CPUs.

    `poll()` is cheap between samples (a clock read) and returns the new count when it changes.
    """

    def __init__(self, budget: CpuBudget, *, sample: Callable[[], CpuSample | None] | None = None,
                 interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.most = budget.threads
        self.cores = budget.affinity
        self.threads = self.most
        #: Cores' worth of this process's CPUs that other processes used over the last interval.
        self.others = 0.0
        self.changes = 0
        self._sample = sample or (lambda: read_sample(budget.cpus))
        self._interval_s = interval_s
        self._last = self._sample()

    def poll(self, now: float | None = None) -> int | None:
        last = self._last
        if last is None or self.most == 1:
            return None
        if (time.monotonic() if now is None else now) - last.at < self._interval_s:
            return None
        current = self._sample()
        if current is None or current.at <= last.at:
            return None
        self._last = current
        wall = current.at - last.at
        self.others = max(0.0, (current.busy_s - last.busy_s) - (current.own_s - last.own_s)) / wall
        threads = threads_for(self.most, self.cores, self.others)
        if threads == self.threads:
            return None
        self.threads = threads
        self.changes += 1
        return threads
