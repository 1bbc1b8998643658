"""A real Redis server process for the shared tier's tests (Debian's redis-server), on a free port."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis


class RedisServer:
    """One `redis-server` process, no persistence, loopback only."""

    def __init__(self, workdir: Path, password: str | None = None) -> None:
        self.workdir = workdir
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed: `make test` installs Debian's redis-server package "
                        "(as root: apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.password = password
        self.binary = binary
        self.start()

    def start(self) -> None:
        """Start the server on its port (again, after `kill`) and wait until it answers."""
        binary, password, workdir = self.binary, self.password, self.workdir
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(workdir)]
        if password is not None:
            args += ["--requirepass", password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client().ping():
                    break
            except redis.ConnectionError:
                assert self.proc.poll() is None, "redis-server exited at start"
                assert time.monotonic() < deadline, "redis-server did not answer PING"
                time.sleep(0.02)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def pause(self) -> None:
        """Stop the process (SIGSTOP): connections stay open and nothing answers, as a hung server."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


class RedisClusterNodes:
    """A three-node Redis Cluster (no replicas) on free ports, made with `redis-cli --cluster create`."""

    def __init__(self, workdir: Path) -> None:
        self.nodes: list[subprocess.Popen] = []
        self.ports: list[int] = []
        for i in range(3):
            node_dir = workdir / f"node{i}"
            node_dir.mkdir()
            # The cluster bus gets a free port of its own: the default, port + 10000, may not exist.
            port, bus = _free_port(), _free_port()
            self.ports.append(port)
            self.nodes.append(subprocess.Popen(
                [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no", "--dir", str(node_dir), "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--cluster-port", str(bus)],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        for port in self.ports:
            _wait_for_ping(redis.Redis(host="127.0.0.1", port=port, socket_timeout=5))
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while redis.Redis(port=self.ports[0]).cluster("info").get("cluster_state") != "ok":
            assert time.monotonic() < deadline, "the cluster never became ok"
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def keys_per_node(self) -> list[int]:
        return [redis.Redis(port=port).dbsize() for port in self.ports]

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()
            node.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_ping(client: redis.Redis) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            if client.ping():
                return
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not answer PING"
            time.sleep(0.02)
