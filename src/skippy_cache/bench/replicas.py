"""The replicas workload: do skippy-cache replicas that share a tier answer like one server?

Three configurations, run one after another on fresh servers that this module starts and stops
(whatever the run's own targets are):

- "shared": N skippy-cache servers whose state stores share one Redis server (`--remote-cache`);
- "alone": N servers, each with only its own tiers;
- "single": one server, the ideal the replicas are held to (one cache sees every request).

Each configuration gets the tenants and chat traffic of those two workloads (the same prompts and
sizes, sent by their own code), spread over its servers request by request: tenant k's round r
and conversation c's turn t go to server (k + r) mod N and (c + t) mod N, so a tenant's or a
conversation's next request lands on another server than its last, as behind a round-robin load
balancer. Chat runs in rounds, as the tenants do (every conversation's turn t before any turn
t + 1), so every round keeps all servers equally busy: free-running conversations drift a turn
apart, and then that schedule sends them all to one server.

Threads: a replica gets max(1, cores // N) llama.cpp threads and the single server N times that
(at most the cores). Every configuration thus has the same CPU, and no two replicas' threads
compete for a core: llama.cpp's threads meet at a barrier after every op, so one descheduled
thread stalls all of them.

Every server runs without a disk tier (`--cache-dir none`), so only the shared tier carries state
between servers and nothing carries over from one configuration to the next; Redis is emptied
(FLUSHALL) before "shared".
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from skippy_cache.bench.run import REPLICAS, Replicas, Run
from skippy_cache.bench.targets import (
    Target,
    free_port,
    launch,
    server_command,
    stop,
    wait_ready,
    weight_layout,
)
from skippy_cache.bench.workloads import calibrate, conversations, tenant_rounds
from skippy_cache.runtime import available_cores

SHARED, ALONE, SINGLE = "shared", "alone", "single"
CONFIGURATIONS = (SHARED, ALONE, SINGLE)
DEFAULT_REPLICAS = 2
#: Redis holds the chunks of every configuration's prompts with room to spare; past it, it evicts
#: the least recently used keys (as a production shared tier would be run).
REDIS_MAXMEMORY = "2gb"
REDIS_STARTUP_S = 20.0
#: The server kind `server_command` starts: skippy-cache with its cache on.
_KIND = "skippy-cache"


class ReplicasError(RuntimeError):
    """The workload cannot run: redis-server is missing or does not start."""


@dataclass(frozen=True, slots=True)
class Configuration:
    """One configuration: `servers` skippy-cache servers of `threads` threads each."""

    name: str
    servers: int
    threads: int
    #: Its servers share one Redis server (`--remote-cache`).
    shared: bool

    def describe(self) -> str:
        """What runs, in a few words (a column header): servers x threads each, and the shared tier."""
        return f"{self.servers} x {self.threads} thr" + (", Redis" if self.shared else "")


@dataclass(frozen=True, slots=True)
class ReplicaSetup:
    """What the workload needs from the run's options."""

    replicas: int
    model: Path
    ctx_size: int
    log_dir: Path
    redis_server: Path
    #: Every server in fast mode (`--fast`); else the default, exact mode.
    fast: bool = False


def configurations(replicas: int, cores: int) -> list[Configuration]:
    """The three configurations, in the order they run; threads as the module docstring says."""
    per_replica = max(1, cores // replicas)
    single = max(1, min(cores, per_replica * replicas))
    return [
        Configuration(SHARED, replicas, per_replica, True),
        Configuration(ALONE, replicas, per_replica, False),
        Configuration(SINGLE, 1, single, False),
    ]


def find_redis_server() -> Path:
    """The redis-server binary on PATH; a `ReplicasError` naming the package to install if there is none."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ReplicasError(
            "the replicas workload needs redis-server on PATH: install Debian's redis-server package "
            "(as root: apt-get install redis-server)"
        )
    return Path(binary)


@dataclass(slots=True)
class RedisServer:
    """The shared tier of the "shared" configuration: one redis-server, no persistence, loopback only."""

    url: str
    command: list[str]
    log_path: Path
    process: subprocess.Popen[bytes]

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=10)

    def flush(self) -> None:
        """Forget every key: a configuration starts with an empty shared tier."""
        with self.client() as client:
            client.flushall()

    def usage(self) -> dict[str, int]:
        """Keys held and memory used, for the JSON."""
        with self.client() as client:
            used = int(client.info("memory")["used_memory"])
            return {"keys": int(client.dbsize()), "used_memory_bytes": used}


def redis_command(binary: Path, port: int, workdir: Path, maxmemory: str = REDIS_MAXMEMORY) -> list[str]:
    """How the workload runs Redis: nothing saved to disk, loopback only, past `maxmemory` the nearest expiry
    time goes first (the replicas set it in the cache's eviction order: sharedorder.py)."""
    return [
        str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--maxmemory", maxmemory, "--maxmemory-policy", "volatile-ttl", "--dir", str(workdir),
    ]


@contextmanager
def running_redis(binary: Path, log_dir: Path) -> Iterator[RedisServer]:
    """Start redis-server on a free port, wait for PING, stop it on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = redis_command(binary, port, log_dir)
    log_path = log_dir / "redis-server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    server = RedisServer(f"redis://127.0.0.1:{port}/0", command, log_path, process)
    try:
        _wait_for_ping(server)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)


def _wait_for_ping(server: RedisServer) -> None:
    deadline = time.monotonic() + REDIS_STARTUP_S
    while True:
        if server.process.poll() is not None:
            tail = "\n".join(server.log_path.read_text(errors="replace").splitlines()[-8:])
            raise ReplicasError(f"redis-server exited with code {server.process.returncode}: {tail}")
        try:
            with server.client() as client:
                if client.ping():
                    return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise ReplicasError(
                f"redis-server did not answer PING within {REDIS_STARTUP_S:g} s (log: {server.log_path})"
            )
        time.sleep(0.05)


def replica_command(
    configuration: Configuration, port: int, model: Path, ctx_size: int, remote_url: str, *, fast: bool,
    repack: bool, secret_file: Path | None = None,
) -> list[str]:
    """The bench's own skippy-cache command (no disk tier), with the configuration's threads and tier.

    The same mode in every configuration (`fast`: fast mode, else the default, exact) and the same
    weight layout (`repack`, targets.weight_layout), so the configurations differ in their tiers alone.
    """
    command = server_command(_KIND, port, model, ctx_size, repack=repack)
    command += (["--fast"] if fast else []) + ["--threads", str(configuration.threads)]
    if not configuration.shared:
        return command
    assert secret_file is not None, "the replicas of a shared tier share a secret"
    return command + ["--remote-cache", remote_url, "--cache-secret-file", str(secret_file)]


def shared_secret(directory: Path) -> Path:
    """A new secret file in `directory` for the replicas of one shared tier (`--cache-secret-file`)."""
    path = directory / "cache-secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    path.chmod(0o600)  # a file left by an older run keeps its mode through O_CREAT
    return path


@contextmanager
def running_configuration(
    configuration: Configuration, *, model: Path, ctx_size: int, log_dir: Path, remote_url: str, fast: bool,
    repack: bool,
) -> Iterator[Replicas]:
    """Start the configuration's servers together, wait for each, stop them all on exit."""
    servers: list[Target] = []
    secret_file = shared_secret(log_dir) if configuration.shared else None
    try:
        for i in range(configuration.servers):
            port = free_port()
            command = replica_command(configuration, port, model, ctx_size, remote_url, fast=fast, repack=repack,
                                      secret_file=secret_file)
            log_path = log_dir / f"replicas-{configuration.name}-{i + 1}.log"
            servers.append(launch(f"{configuration.name} #{i + 1}", _KIND, command, log_path, port))
        wait_ready(servers)
        yield Replicas(configuration.name, servers)
    finally:
        for server in servers:
            stop(server)


async def _warm_up(run: Run, group: Replicas) -> None:
    """Every configuration's servers answer the bench's calibration requests before anything is timed.

    The first configuration's measured tokens-per-word sets the prompt sizes of all three, so
    every configuration is sent the same prompts.
    """
    first = not run.calibration
    known = (run.tokens_per_word, run.calibration)
    run.targets = group.members
    await calibrate(run)
    if not first:
        run.tokens_per_word, run.calibration = known


async def _cache_answer(run: Run, server: Target) -> dict[str, object] | None:
    """The server's GET /v1/cache, None if it does not answer."""
    if server.error is not None:
        return None
    try:
        response = await run.client.get_json(server.url, "/v1/cache")
    except (httpx.HTTPError, OSError, ValueError):  # a server that is gone costs this record, not the run
        return None
    return response if isinstance(response, dict) else None


async def replicas(run: Run, setup: ReplicaSetup, say: Callable[[str], None]) -> dict[str, object]:
    """Run the three configurations one after another; what the JSON records of them.

    `run` records the requests (workload "replicas", target the configuration's name, groups
    "tenants: ..." and "chat: ..."); `say` prints a line between configurations.
    """
    described: list[dict[str, object]] = []
    shared_usage: dict[str, int] | None = None
    repack = weight_layout(setup.model).use_extra_bufts
    with running_redis(setup.redis_server, setup.log_dir) as redis_server:
        for configuration in configurations(setup.replicas, available_cores()):
            if configuration.shared:
                redis_server.flush()
            with running_configuration(
                configuration,
                model=setup.model,
                ctx_size=setup.ctx_size,
                log_dir=setup.log_dir,
                remote_url=redis_server.url,
                fast=setup.fast,
                repack=repack,
            ) as group:
                states = ", ".join(f"NOT READY: {s.error}" if s.error else "ready" for s in group.members)
                say(f"replicas: {configuration.name} ({configuration.describe()}): {states}")
                await _warm_up(run, group)
                await tenant_rounds(run, group, REPLICAS, "tenants: ")
                await conversations(run, group, REPLICAS, "chat: ", in_rounds=True)
                caches = [await _cache_answer(run, server) for server in group.members]
            if configuration.shared:
                shared_usage = redis_server.usage()
            described.append(
                {
                    "name": configuration.name,
                    "summary": configuration.describe(),
                    "servers": configuration.servers,
                    "threads_per_server": configuration.threads,
                    "shared_tier": configuration.shared,
                    "targets": [s.describe() for s in group.members],
                    # Each server's /v1/cache at the end: why a later round missed (a lookup
                    # that timed out is an `errors` of its `remote` section).
                    "caches": caches,
                }
            )
    return {
        "replicas": setup.replicas,
        "mode": "fast" if setup.fast else "exact",
        "cores": available_cores(),
        "calibration": run.calibration,
        "redis": {"command": redis_server.command, "after_shared": shared_usage},
        "configurations": described,
    }
