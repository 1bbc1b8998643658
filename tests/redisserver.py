"""A real Redis server process for the shared tier's tests (Debian's redis-server), on a free port."""

from __future__ import annotations

import shutil
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
