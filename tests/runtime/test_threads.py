"""The thread count follows the cores the process may use (affinity, cgroup quota) and, step by
step, the cores other processes leave free; no model is loaded here."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skippy_cache.runtime.threads import (
    WAIT_POLICY_ENV,
    CpuBudget,
    CpuSample,
    ThreadGovernor,
    cgroup_quota,
    cpu_budget,
    read_sample,
    threads_for,
    wait_policy,
)

V1_MOUNTS = (
    "30 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
    "31 25 0:27 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"
)
V2_MOUNTS = "29 23 0:25 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"


def fake_root(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    (tmp_path / "proc/self/mountinfo").write_text(mountinfo)
    for name, text in files.items():
        path = tmp_path / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_v2_quota_of_the_process_cgroup(tmp_path: Path) -> None:
    root = fake_root(tmp_path, "0::/app\n", V2_MOUNTS, {"/sys/fs/cgroup/app/cpu.max": "150000 100000\n"})
    assert cgroup_quota(root) == 1.5


def test_v2_max_is_no_quota(tmp_path: Path) -> None:
    root = fake_root(tmp_path, "0::/app\n", V2_MOUNTS, {"/sys/fs/cgroup/app/cpu.max": "max 100000\n"})
    assert cgroup_quota(root) is None


def test_v2_an_ancestor_quota_binds(tmp_path: Path) -> None:
    # A pod's limit sits above its container's: the tighter one wins, wherever it is.
    root = fake_root(tmp_path, "0::/pod/box\n", V2_MOUNTS, {
        "/sys/fs/cgroup/pod/cpu.max": "100000 100000\n",
        "/sys/fs/cgroup/pod/box/cpu.max": "400000 100000\n",
    })
    assert cgroup_quota(root) == 1.0


def test_v2_inside_a_container_whose_mount_root_is_its_cgroup(tmp_path: Path) -> None:
    mounts = "29 23 0:25 /kube/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    root = fake_root(tmp_path, "0::/kube/pod1\n", mounts, {"/sys/fs/cgroup/cpu.max": "200000 100000\n"})
    assert cgroup_quota(root) == 2.0


def test_v1_quota_and_unlimited(tmp_path: Path) -> None:
    root = fake_root(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/x\n", V1_MOUNTS, {
        "/sys/fs/cgroup/cpu,cpuacct/x/cpu.cfs_quota_us": "50000\n",
        "/sys/fs/cgroup/cpu,cpuacct/x/cpu.cfs_period_us": "100000\n",
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
        "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    assert cgroup_quota(root) == 0.5


def test_no_cgroup_files_is_no_quota(tmp_path: Path) -> None:
    assert cgroup_quota(tmp_path) is None
    root = fake_root(tmp_path, "0::/\n", V2_MOUNTS, {})
    assert cgroup_quota(root) is None


@pytest.mark.parametrize(("affinity", "quota", "threads"), [
    (8, None, 8),
    (8, 2.0, 2),
    # Rounded down: the server's other threads draw on the same quota.
    (8, 2.5, 2),
    (8, 0.5, 1),
    (2, 16.0, 2),
    (1, None, 1),
])
def test_thread_count_from_affinity_and_quota(affinity: int, quota: float | None, threads: int) -> None:
    assert CpuBudget(frozenset(range(affinity)), quota).threads == threads


def test_affinity_mask_sets_the_default_threads() -> None:
    """A process pinned to one core gets one thread, whatever os.cpu_count() says."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
            "from skippy_cache.runtime.threads import cpu_budget; print(cpu_budget().affinity, cpu_budget().threads)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", "1"]
    assert cpu_budget().affinity == len(os.sched_getaffinity(0))


def test_a_busy_machine_takes_the_cores_it_uses() -> None:
    # 2 cores: one busy process beside a team of 2 gets about 2/3 of a core; beside a team of 1, all
    # of one. Either way the team is 1, and back to 2 once the other process is gone.
    assert threads_for(2, 2, 0.67) == 1
    assert threads_for(2, 2, 1.0) == 1
    assert threads_for(2, 2, 0.1) == 2
    # A core counts as free when others leave 75% of it.
    assert threads_for(8, 8, 3.2) == 5
    assert threads_for(8, 8, 3.3) == 4
    # Never none, never past the budget.
    assert threads_for(2, 2, 5.0) == 1
    assert threads_for(2, 64, 10.0) == 2


class Clock:
    """Samples made by hand: CPU seconds busy on the process's CPUs and the process's own."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 0.0, 0.0, 0.0

    def sample(self) -> CpuSample:
        return CpuSample(self.busy, self.own, self.now)

    def run(self, seconds: float, own_cores: float, other_cores: float) -> None:
        self.now += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds


def test_the_governor_follows_other_processes_and_reads_no_more_than_twice_a_second() -> None:
    clock = Clock()
    governor = ThreadGovernor(CpuBudget(frozenset({0, 1}), None), sample=clock.sample)
    assert governor.threads == 2
    clock.run(0.2, own_cores=2.0, other_cores=0.0)
    assert governor.poll(clock.now) is None  # not yet an interval
    clock.run(0.4, own_cores=2.0, other_cores=0.0)
    assert governor.poll(clock.now) is None and governor.others == 0.0
    clock.run(0.6, own_cores=1.33, other_cores=0.67)  # a busy process starts
    assert governor.poll(clock.now) == 1
    assert governor.others == pytest.approx(0.67)
    clock.run(0.6, own_cores=1.0, other_cores=1.0)
    assert governor.poll(clock.now) is None and governor.threads == 1
    clock.run(0.6, own_cores=2.0, other_cores=0.05)  # it ended
    assert governor.poll(clock.now) == 2
    assert governor.changes == 2


def test_a_budget_of_one_core_or_no_proc_never_changes() -> None:
    clock = Clock()
    one = ThreadGovernor(CpuBudget(frozenset({0}), None), sample=clock.sample)
    clock.run(1.0, own_cores=0.5, other_cores=0.5)
    assert one.poll(clock.now) is None and one.threads == 1
    blind = ThreadGovernor(CpuBudget(frozenset({0, 1}), None), sample=lambda: None)
    assert blind.poll(10.0) is None and blind.threads == 2


def test_samples_read_this_machines_proc() -> None:
    cpus = frozenset(os.sched_getaffinity(0))
    first = read_sample(cpus)
    assert first is not None
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    second = read_sample(cpus)
    assert second is not None
    # This process spun for 0.2 s of CPU: its own time grew by about that, and the CPUs' busy time
    # by at least that (ticks are 10 ms).
    assert 0.15 <= second.own_s - first.own_s <= 0.5
    assert second.busy_s - first.busy_s >= 0.15


def test_the_start_up_words_name_the_environments_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WAIT_POLICY_ENV, raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert "libgomp's default" in wait_policy()
    monkeypatch.setenv(WAIT_POLICY_ENV, "PASSIVE")
    assert "OMP_WAIT_POLICY=PASSIVE" in wait_policy()
