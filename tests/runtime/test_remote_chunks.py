"""The shared tier's network side on a real Redis server, without a model: writes, lookups, faults, the breaker."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
import redis

from skippy_cache.chunks import Chunk, seal
from skippy_cache.runtime.remote import Breaker, RemoteChunks, RemoteConfig, redact
from skippy_cache.sharedorder import Turnover

pytestmark = pytest.mark.timeout(120)


def value(key: str, n: int = 1000) -> bytes:
    return seal(Chunk(key, 64, bytes(range(256)) * (n // 256 + 1)), bytes(32))


def key(i: int) -> str:
    return f"{i:032x}"


@pytest.fixture
def remote(redis_server):
    chunks = RemoteChunks(RemoteConfig(url=redis_server.url, ttl_s=600, retry_s=0.1))
    yield chunks
    chunks.close()


def test_written_behind_then_found_and_fetched(remote, redis_server):
    for i in range(3):
        assert remote.put(key(i), value(key(i)))
    assert remote.flush(10)
    assert remote.present([key(0), key(1), key(5), key(2)]) == [True, True, False, True]
    got = remote.fetch([key(1), key(5)])
    assert got == [value(key(1)), None]
    stats = remote.stats()
    assert (stats.writes, stats.hits, stats.bytes_out) == (3, 1, 3 * len(value(key(0))))
    client = redis_server.client()
    assert 0 < client.ttl(remote.name(key(0))) <= 600
    # Names carry a prefix and the state format's digest, never bare chunk keys.
    assert all(k.decode().startswith("skippy:") for k in client.keys())


def test_a_chunk_the_server_holds_is_not_sent_again(remote, redis_server):
    remote.put(key(7), value(key(7)))
    remote.flush(10)
    redis_server.client().expire(remote.name(key(7)), 5)
    remote.put(key(7), value(key(7)))
    remote.flush(10)
    stats = remote.stats()
    assert (stats.writes, stats.present) == (1, 1)
    assert redis_server.client().ttl(remote.name(key(7))) > 5  # renewed, not rewritten


def test_a_server_under_volatile_ttl_evicts_a_prompts_last_chunks_first(redis_server):
    client = redis_server.client()
    client.config_set("maxmemory-policy", "volatile-ttl")
    client.config_set("maxmemory-samples", "10")  # every key sampled: the order exactly, not nearly
    remote = RemoteChunks(RemoteConfig(url=redis_server.url, retry_s=0.1))
    remote.turnover = Turnover(poll_s=0.0, min_evictions=1)
    try:
        a = [key(i) for i in range(4)]
        for k, due in zip(a, remote.deadlines(4, reused=0, tail_repeat_only=True), strict=True):
            assert remote.put(k, value(k, 200_000), due)
        assert remote.flush(10)
        ttls = [client.pttl(remote.name(k)) for k in a]
        assert ttls == sorted(ttls, reverse=True) and len(set(ttls)) == 4, ttls  # first chunk last to go
        used = client.info("memory")["used_memory"]
        client.config_set("maxmemory", str(used + 300_000))  # room for one more chunk, not three
        b = [key(i) for i in range(10, 13)]
        for k in b:
            assert remote.put(k, value(k, 200_000))
            assert remote.flush(10)
        held = [client.exists(remote.name(k)) == 1 for k in a]
        assert held[0] and not held[-1], held  # A's tail went before its first chunk
        stats = remote.stats()
        assert client.info("stats")["evicted_keys"] > 0 and stats.turnover_s > 0, stats
    finally:
        remote.close()
        client.config_set("maxmemory", "0")
        client.config_set("maxmemory-policy", "noeviction")


def test_a_chunk_this_process_holds_is_only_renewed(remote, redis_server):
    remote.put(key(3), value(key(3)))
    remote.put(key(4), None)  # held here, never written there: nothing to renew, nothing sent
    remote.flush(10)
    client = redis_server.client()
    before = client.pttl(remote.name(key(3)))
    (later,) = remote.deadlines(1, reused=1, tail_repeat_only=False)
    remote.put(key(3), None, later + 60)
    remote.flush(10)
    assert client.pttl(remote.name(key(3))) > before + 50_000
    assert not client.exists(remote.name(key(4)))
    assert remote.stats().writes == 1


def test_a_value_queued_behind_its_own_renewal_is_still_written(remote, redis_server):
    sending, release = threading.Event(), threading.Event()
    send = remote._send

    def held_send(batch):
        sending.set()
        release.wait(10)
        send(batch)

    remote._send = held_send
    remote.put(key(1), value(key(1)))
    assert sending.wait(10)  # the writer holds key 1's batch; what follows queues behind it
    remote.put(key(2), None)  # renewal only: the server does not hold key 2
    remote.put(key(2), value(key(2)))  # then this process has its bytes to send after all
    remote.put(key(1), None)  # key 1 is being written: nothing more to queue
    release.set()
    assert remote.flush(10)
    assert remote.fetch([key(1), key(2)]) == [value(key(1)), value(key(2))]
    assert (remote.stats().writes, remote.stats().present) == (2, 0)


def test_the_write_queue_drops_rather_than_grows(redis_server):
    small, big = value(key(1)), value(key(2), 4000)
    chunks = RemoteChunks(RemoteConfig(url=redis_server.url, max_pending_bytes=len(big) - 1))
    try:
        assert chunks.put(key(1), small)
        assert not chunks.put(key(2), big)  # more than the queue may ever hold: dropped, not waited for
        assert chunks.flush(10)
        stats = chunks.stats()
        assert (stats.writes, stats.dropped, stats.pending_bytes) == (1, 1, 0)
    finally:
        chunks.close()


def test_a_server_that_goes_away_opens_the_breaker_and_comes_back(redis_server, caplog):
    chunks = RemoteChunks(RemoteConfig(url=redis_server.url, retry_s=0.05))
    caplog.set_level(logging.WARNING, logger="skippy_cache.remote")
    try:
        assert chunks.present([key(1)]) == [False]
        redis_server.kill()
        assert chunks.present([key(1)]) is None
        assert not chunks.stats().up
        assert chunks.present([key(1)]) is None  # breaker open: no round trip
        assert chunks.stats().lookups_skipped >= 1
        assert not chunks.put(key(1), value(key(1)))  # writes are dropped while down
        redis_server.start()  # the same port again
        deadline = time.monotonic() + 10
        while chunks.present([key(1)]) is None:
            assert time.monotonic() < deadline, "the tier never came back"
            time.sleep(0.06)
        assert chunks.stats().up
    finally:
        chunks.close()
    messages = [r.getMessage() for r in caplog.records]
    down = [m for m in messages if "is down" in m]
    assert len(down) == 1, f"the log says once that the tier is down: {messages}"
    assert str(redis_server.port) in down[0]
    assert sum("is back" in m for m in messages) == 1


def test_breaker_retries_once_per_interval_and_logs_each_change_once(caplog):
    now = [0.0]
    breaker = Breaker("remote cache x", retry_s=5, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="skippy_cache.remote")
    assert breaker.allow()
    breaker.failed(ConnectionError("refused"))
    breaker.failed(ConnectionError("refused"))
    assert not breaker.up and not breaker.allow()
    now[0] = 5.0
    assert breaker.allow()  # one trial
    assert not breaker.allow()  # and only one per interval
    breaker.succeeded()
    breaker.succeeded()
    assert breaker.up and breaker.allow()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("is down" in m for m in messages) == 1
    assert sum("is back" in m for m in messages) == 1


def test_a_timeout_is_a_miss_and_only_timeouts_in_a_row_open_the_breaker():
    # On a loaded host one lookup can miss its 50 ms while the server is fine: that must not
    # cut a replica off its peers for retry_s. A server that hangs still opens it.
    breaker = Breaker("remote cache x", retry_s=5, clock=lambda: 0.0, timeouts_to_open=3)
    for _ in range(2):
        breaker.failed(redis.TimeoutError("Timeout reading from socket"))
        assert breaker.up
    breaker.succeeded()  # a round trip in between: the count starts again
    breaker.failed(redis.TimeoutError("Timeout reading from socket"))
    breaker.failed(redis.TimeoutError("Timeout reading from socket"))
    assert breaker.up
    breaker.failed(redis.TimeoutError("Timeout reading from socket"))
    assert not breaker.up and not breaker.allow()


def test_credentials_never_shown():
    assert redact("redis://user:pw@host:6379/0") == "redis://host:6379/0"
    assert redact("rediss://:pw@host/1") == "rediss://host/1"
    assert redact("unix:///run/redis.sock") == "unix:///run/redis.sock"
    config = RemoteConfig(url="redis://u:secret@h:1/0", password="other-secret")
    assert "secret" not in repr(config)


def test_a_cluster_spreads_the_chunks_over_its_nodes(redis_cluster):
    chunks = RemoteChunks(RemoteConfig(url=redis_cluster.url, cluster=True))
    try:
        keys = [key(i) for i in range(30)]
        for k in keys:
            assert chunks.put(k, value(k))
        assert chunks.flush(20)
        assert chunks.stats().writes == 30
        assert all(n > 0 for n in redis_cluster.keys_per_node()), redis_cluster.keys_per_node()
        assert chunks.present([*keys, key(99)]) == [True] * 30 + [False]
        assert chunks.fetch(keys[:10]) == [value(k) for k in keys[:10]]
        assert chunks._server_counts() == (0, 30)  # summed over the cluster's primaries
    finally:
        chunks.close()


def test_a_unix_socket_url(tmp_path):
    import subprocess

    import redis

    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server did not open its socket"
            time.sleep(0.02)
        chunks = RemoteChunks(RemoteConfig(url=f"unix://{sock}"))
        try:
            assert chunks.put(key(3), value(key(3)))
            assert chunks.flush(10)
            assert chunks.present([key(3)]) == [True]
            assert redis.Redis(unix_socket_path=str(sock)).dbsize() == 1
        finally:
            chunks.close()
    finally:
        proc.kill()
        proc.wait(10)


def test_tls_with_the_servers_ca(tmp_path):
    import subprocess

    from redisserver import _free_port

    cert, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key_file),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    port = _free_port()
    proc = subprocess.Popen(["redis-server", "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert),
                             "--tls-key-file", str(key_file), "--tls-ca-cert-file", str(cert),
                             "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while True:  # until the server listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "redis-server (TLS) did not start"
            time.sleep(0.05)
    url = f"rediss://127.0.0.1:{port}/0"
    trusted = RemoteChunks(RemoteConfig(url=url, tls_ca_file=str(cert), timeout_ms=2000))
    untrusted = RemoteChunks(RemoteConfig(url=url, timeout_ms=2000))
    try:
        assert trusted.put(key(4), value(key(4))) and trusted.flush(10)
        assert trusted.present([key(4)]) == [True]
        # A certificate the client cannot check is a failed round trip (a miss), never a plaintext fallback.
        assert untrusted.present([key(4)]) is None and untrusted.stats().errors == 1
    finally:
        trusted.close()
        untrusted.close()
        proc.kill()
        proc.wait(10)
