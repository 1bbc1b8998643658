"""How long one replica's lookup waits behind another replica's writes on the same Redis server.

    .venv/bin/python benchmarks/remote_lookup.py [--batches 16,4,1] [--lookups 300]

A lookup is the shared tier's one pipelined round trip before a request is
queued (10 EXISTS here), and it has a small timeout (50 ms by default). Redis
runs one command at a time, so a lookup that arrives behind another client's
pipeline of SETs waits for all of it. For each batch size, a writer thread
sends pipelines of that many 1.5 MiB values (a chunk of 64 tokens of
SmolLM2-135M) without pause while the main thread times lookups every 10 ms.
Prints the lookup's p50 / p90 / p99 / max in ms per batch size. Needs
redis-server on PATH (Debian's redis-server package).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import threading
import time

import redis

CHUNK_BYTES = 1_500_000
LOOKUP_KEYS = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_without_pause(port: int, batch: int, stop: threading.Event) -> None:
    client = redis.Redis(port=port)
    value = os.urandom(CHUNK_BYTES)
    i = 0
    while not stop.is_set():
        pipe = client.pipeline(transaction=False)
        keys = [f"chunk:{i + j}" for j in range(batch)]
        for key in keys:
            pipe.set(key, value, ex=60)
        pipe.execute()
        client.delete(*keys)  # keep the server's memory flat
        i += batch


def lookup_ms(port: int, batch: int, lookups: int) -> list[float]:
    stop = threading.Event()
    writer = threading.Thread(target=write_without_pause, args=(port, batch, stop))
    writer.start()
    client = redis.Redis(port=port)
    times = []
    try:
        for _ in range(lookups):
            t0 = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for j in range(LOOKUP_KEYS):
                pipe.exists(f"wanted:{j}")
            pipe.execute()
            times.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.01)
    finally:
        stop.set()
        writer.join()
    return sorted(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="16,4,1", help="chunks per write pipeline, comma-separated")
    parser.add_argument("--lookups", type=int, default=300)
    args = parser.parse_args()
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("needs redis-server on PATH (apt-get install redis-server)")
    port = free_port()
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=port).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        print(f"lookup of {LOOKUP_KEYS} keys while another client writes {CHUNK_BYTES / 1e6:.1f} MB values")
        print(f"{'chunks per write pipeline':>26} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>7}  (ms)")
        for batch in (int(b) for b in args.batches.split(",")):
            t = lookup_ms(port, batch, args.lookups)
            n = len(t)
            print(f"{batch:>26} {t[n // 2]:7.2f} {t[n * 9 // 10]:7.2f} {t[min(n - 1, n * 99 // 100)]:7.2f} "
                  f"{t[-1]:7.2f}")
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
