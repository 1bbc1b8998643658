"""The shared tier: the state store's chunks on a Redis or Valkey server, so every replica restores what any computed.

Keys are `skippy:<format>:<chunk key>`: `<format>` is a short digest of the
state format version, and the chunk key (chunks.py) already names the model,
KV layout, namespace (`cache_salt`) and tokens, so replicas need no
coordination: identical chunks from two replicas are one key and one value,
and two tenants never share a key. Values are the sealed chunks, their
keyed MAC included (chunks.py: replicas share the secret, `--cache-secret-file`);
every value read is verified before it is imported, and one that fails is a
miss (counted as `rejected`), never imported, and deleted from the server.

The server evicts: run it with `maxmemory` and `maxmemory-policy volatile-ttl`.
Every use of a chunk sets its expiry time from the cache's eviction order
(sharedorder.py): about `ttl_s` ahead, longer for a chunk used again, and never
before a later chunk of the same prompt, so a server that evicts the nearest
expiry first evicts in that order. The writer reads the server's eviction
counters every few seconds for the order's time scale. Under `allkeys-lru` the
expiry times are only TTLs and the server evicts by LRU. A chunk missing in the
middle of a run ends the run.

Threads: nothing here runs on the engine thread. Reads run on the caller's
thread (the engine's prefetch workers) and are bounded by small socket
timeouts; writes are queued (`put`) and sent in pipelined batches by a
writer thread, and the queue drops rather than blocks when it is full. A
refused connection, or a few timeouts in a row, open the breaker: until it
retries, reads answer "nothing" at once and writes are dropped; the log
says once that the tier is down and once that it is back.

Credentials never reach the log or the stats: the URL is shown without its
user info.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import redis
from blake3 import blake3
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from skippy_cache.sharedorder import Turnover, deadlines
from skippy_cache.stateformat import FORMAT_VERSION

log = logging.getLogger("skippy_cache.remote")

#: Round-trip time buckets of the latency histogram, in seconds.
RTT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

#: Chunks a writer batch sends in one pipeline at most. The server runs one command at a time:
#: another replica's lookup that arrives behind a pipeline of many MiB waits for all of it, and
#: a lookup has a small timeout. A few chunks per pipeline keep that wait short.
_BATCH_CHUNKS = 4


@dataclass(frozen=True, kw_only=True)
class RemoteConfig:
    #: `redis://[user:password@]host:port[/db]`, `rediss://` (TLS) or `unix:///path/to.sock`.
    #: Out of the repr, as the password: a config that gets logged must not leak them.
    url: str = field(repr=False)
    #: Overrides a password in the URL (read from `--remote-cache-password-file`).
    password: str | None = field(default=None, repr=False)
    #: Seconds a key lives unless used again (each use renews it; sharedorder.py).
    ttl_s: int = 24 * 3600
    #: Connect and lookup timeout: a lookup waits this long at most before it is a miss.
    timeout_ms: float = 50.0
    #: Timeout of a transfer (fetching or writing chunks of several MiB each).
    transfer_timeout_ms: float = 2000.0
    #: Chunks waiting for the writer, at most; past it new writes are dropped.
    max_pending_bytes: int = 256 << 20
    #: Seconds between retries while the server is down.
    retry_s: float = 5.0
    prefix: str = "skippy"
    #: The URL names one node of a Redis Cluster (or Valkey cluster): keys spread over its nodes.
    cluster: bool = False
    #: With `rediss://`: the CA certificate(s) the server's certificate must chain to (None: the system's).
    tls_ca_file: str | None = None


@dataclass(frozen=True, slots=True)
class RemoteStats:
    url: str
    up: bool
    #: Lookups that asked the server, and those skipped because the breaker was open.
    lookups: int
    lookups_skipped: int
    #: Chunks fetched and verified; chunks looked up and not found; values that failed verification.
    hits: int
    misses: int
    rejected: int
    bytes_in: int
    bytes_out: int
    #: Chunks written; chunks not sent because the server held them already; writes dropped
    #: (queue full or server down).
    writes: int
    present: int
    dropped: int
    pending_bytes: int
    #: Failed round trips (timeouts, refused connections, protocol errors).
    errors: int
    #: Round trips per `RTT_BUCKETS` bucket (not cumulative; one more for the rest), their sum in seconds.
    rtt_counts: tuple[int, ...]
    rtt_sum: float
    #: The server's turnover (keys held over keys evicted per second; 0 until it evicts), seconds.
    turnover_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Prefetched:
    """What `prefetch` brought from the shared tier for one prompt."""

    #: Leading tokens whose chunks were held here already; the shared tier's run starts after them.
    local_tokens: int
    #: Tokens brought into RAM from the shared tier past `local_tokens`: its chunks, and a
    #: partial chunk that ended the run (0: none).
    tokens: int
    #: The whole prompt's tail (with its first-token logits) came too.
    whole: bool
    #: Time the lookup and the transfer took.
    ms: float

    def covers(self, length: int) -> bool:
        """A hit of `length` tokens uses chunks from the shared tier."""
        return (self.tokens > 0 or self.whole) and length > self.local_tokens


def redact(url: str) -> str:
    """The URL without user or password, for logs and stats."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


class Breaker:
    """Down after a failure, retried every `retry_s`; logs each change of state once.

    A refused connection or a protocol error opens it at once. A timeout alone
    may be a busy machine rather than a dead server (on a loaded host a lookup
    can miss its 50 ms while the server is fine): it is a miss for the one
    request, and the breaker opens after `timeouts_to_open` in a row, so a
    server that hangs still costs only a few requests that many milliseconds.
    """

    def __init__(
        self, what: str, retry_s: float, clock: Callable[[], float] = time.monotonic, timeouts_to_open: int = 3
    ) -> None:
        self.what = what
        self.retry_s = retry_s
        self.clock = clock
        self.timeouts_to_open = timeouts_to_open
        self.up = True
        self._retry_at = 0.0
        self._timeouts = 0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """May a round trip be tried now? While down, one caller per `retry_s` gets to try."""
        with self._lock:
            if self.up:
                return True
            now = self.clock()
            if now < self._retry_at:
                return False
            self._retry_at = now + self.retry_s
            return True

    def succeeded(self) -> None:
        with self._lock:
            self._timeouts = 0
            if self.up:
                return
            self.up = True
        log.warning("%s is back", self.what)

    def failed(self, error: Exception) -> None:
        with self._lock:
            if self.up and _is_timeout(error):
                self._timeouts += 1
                if self._timeouts < self.timeouts_to_open:
                    return
            self._timeouts = 0
            self._retry_at = self.clock() + self.retry_s
            if not self.up:
                return
            self.up = False
        log.warning("%s is down (%s: %s); requests go on without it, retrying every %g s",
                    self.what, type(error).__name__, error, self.retry_s)


def _is_timeout(error: Exception) -> bool:
    return isinstance(error, (redis.TimeoutError, TimeoutError))


class RemoteChunks:
    """Sealed chunks on a Redis/Valkey server: pipelined lookups and reads, write-behind writes."""

    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self.url = redact(config.url)
        digest = blake3(FORMAT_VERSION.encode()).hexdigest(length=4)
        self._prefix = f"{config.prefix}:{digest}:"
        self.breaker = Breaker(f"remote cache {self.url}", config.retry_s)
        #: Clients by timeout (lookups, transfers), connected on first use: a cluster client
        #: asks for the slot map when it is made, and a server that is down at start must not stop it.
        self._clients: dict[float, redis.Redis | RedisCluster] = {}
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        #: Keys in send order; each queued key's (sealed value or None to renew only, expiry
        #: time in Unix seconds); whether each key the writer is sending carries a value.
        self._queue: deque[str] = deque()
        self._items: dict[str, tuple[bytes | None, float]] = {}
        self._sending: dict[str, bool] = {}
        self._pending_bytes = 0
        self._closing = False
        self._counts = dict.fromkeys(
            ("lookups", "lookups_skipped", "hits", "misses", "rejected", "bytes_in", "bytes_out",
             "writes", "present", "dropped", "errors"), 0)
        self._rtt = [0] * (len(RTT_BUCKETS) + 1)
        self._rtt_sum = 0.0
        self.turnover = Turnover()
        self._writer = threading.Thread(target=self._write_loop, name="skippy-remote-writer", daemon=True)
        self._writer.start()

    def _client(self, timeout_ms: float) -> redis.Redis | RedisCluster:
        with self._lock:
            client = self._clients.get(timeout_ms)
        if client is not None:
            return client
        # No retries inside the client: a retry would multiply the timeout a
        # lookup may take; the breaker decides when to try again.
        options: dict[str, object] = {
            "password": self.config.password,
            "socket_timeout": timeout_ms / 1000,
            "socket_connect_timeout": timeout_ms / 1000,
            "retry": Retry(NoBackoff(), 0),
        }
        if self.config.tls_ca_file is not None:
            options["ssl_ca_certs"] = self.config.tls_ca_file
        if self.config.cluster:
            client = RedisCluster.from_url(self.config.url, **options)
        else:
            client = redis.Redis.from_url(self.config.url, health_check_interval=0, **options)
        with self._lock:
            return self._clients.setdefault(timeout_ms, client)

    @property
    def write_timeout_s(self) -> float:
        """How long a write may take at most: the batch being sent, then this one (two round trips each)."""
        return 4 * self.config.transfer_timeout_ms / 1000

    def name(self, key: str) -> str:
        """The server's key for chunk `key`."""
        return self._prefix + key

    def deadlines(self, n_keys: int, *, reused: int, tail_repeat_only: bool) -> list[float]:
        """Expiry times (Unix seconds) of a prompt's keys used now (sharedorder.py)."""
        with self._lock:
            turnover = self.turnover.value
        return deadlines(time.time(), n_keys, reused=reused, tail_repeat_only=tail_repeat_only,
                         turnover=turnover, ttl=self.config.ttl_s)

    # -- reads (the caller's thread) -------------------------------------------------------

    def present(self, keys: Sequence[str]) -> list[bool] | None:
        """Which of `keys` the server holds, in one pipelined round trip; None if it could not say."""
        if not keys:
            return []
        if not self.breaker.allow():
            self._count(lookups_skipped=1)
            return None
        self._count(lookups=1)
        answers = self._round_trip(self.config.timeout_ms, [("exists", self.name(key)) for key in keys])
        return None if answers is None else [bool(n) for n in answers]

    def fetch(self, keys: Sequence[str]) -> list[bytes | None] | None:
        """The values of `keys` (None where the server has none), each key renewed as a chunk used again;
        None on failure.

        The values are NOT verified here: the caller unseals each before use
        and reports a failure with `rejected`.
        """
        if not keys:
            return []
        if not self.breaker.allow():
            self._count(lookups_skipped=1)
            return None
        (due,) = self.deadlines(1, reused=1, tail_repeat_only=False)
        values = self._round_trip(self.config.transfer_timeout_ms,
                                  [("getex", self.name(key), {"pxat": _ms(due)}) for key in keys])
        if values is None:
            return None
        found = [v for v in values if v is not None]
        self._count(hits=len(found), misses=len(values) - len(found), bytes_in=sum(len(v) for v in found))
        return values

    def missed(self, n: int = 1) -> None:
        """Chunks a lookup asked about that the server did not hold."""
        self._count(misses=n)

    def rejected(self, key: str, error: Exception) -> None:
        """A fetched value failed verification: counted, logged, never imported, and deleted.

        Deleted, not left to expire: a replica that writes a chunk the server holds only renews
        the held value, so a forged or corrupt value would otherwise stand in for the real one
        for as long as anyone uses the prompt.
        """
        self._count(rejected=1, hits=-1)
        log.warning("remote cache: refused chunk %s: %s", key, error)
        if self.breaker.allow():
            self._round_trip(self.config.timeout_ms, [("delete", self.name(key))])

    # -- writes (any thread queues; the writer sends) --------------------------------------

    def put(
        self, key: str, value: bytes | None, deadline: float | None = None, *, first: bool = False
    ) -> bool:
        """Queue a sealed chunk for the server, to expire at `deadline` (Unix seconds; default: a new
        chunk's, `ttl_s` ahead; `first`: ahead of what is queued). With `value` None the chunk is only
        renewed if the server holds it (this process holds it already and sends no bytes). A chunk
        queued or being sent is not queued again, unless only its renewal is and this brings its
        value. False (dropped) if the queue is full or the tier is down."""
        if deadline is None:
            (deadline,) = self.deadlines(1, reused=0, tail_repeat_only=False)
        size = len(value) if value is not None else 0
        with self._cv:
            queued, sending = self._items.get(key), self._sending.get(key)
            if queued is None and sending is not None and (sending or value is None):
                return True  # being sent, with at least these bytes
            if queued is not None and (queued[0] is not None or value is None):
                return True
            if not self.breaker.up or self._pending_bytes + size > self.config.max_pending_bytes:
                self._counts["dropped"] += 1
                return False
            if queued is not None:
                # A renew-only write still queued gets the bytes: sent alone, it would renew
                # nothing on a server that does not hold the chunk, and the value would be lost.
                self._items[key] = (value, max(deadline, queued[1]))
            else:
                self._items[key] = (value, deadline)
                if first:
                    self._queue.appendleft(key)
                else:
                    self._queue.append(key)
            self._pending_bytes += size
            self._cv.notify()
        return True

    def wait_sent(self, keys: Sequence[str], timeout: float) -> bool:
        """Wait until none of `keys` is queued or being sent (each was written, found held, or
        dropped); False on timeout."""
        wanted = set(keys)
        with self._cv:
            return self._cv.wait_for(
                lambda: self._items.keys().isdisjoint(wanted) and self._sending.keys().isdisjoint(wanted),
                timeout)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write was sent (or dropped); False on timeout (tests, shutdown)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._sending, timeout)

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                batch: list[tuple[str, bytes | None, float]] = []
                while self._queue and len(batch) < _BATCH_CHUNKS:
                    key = self._queue.popleft()
                    value, deadline = self._items.pop(key)
                    batch.append((key, value, deadline))
                    self._sending[key] = value is not None
            try:
                self._send(batch)
                self._poll_turnover()
            finally:
                with self._cv:
                    for key, value, _ in batch:
                        del self._sending[key]
                        self._pending_bytes -= len(value) if value is not None else 0
                    self._cv.notify_all()

    def _send(self, batch: list[tuple[str, bytes | None, float]]) -> None:
        """Write a batch: one round trip renews the keys the server holds (and says which), one sends
        the values of the rest."""
        if not self.breaker.allow():
            self._count(dropped=len(batch))
            return
        held = self._round_trip(self.config.transfer_timeout_ms,
                                [("pexpireat", self.name(key), _ms(due)) for key, _, due in batch])
        if held is None:
            self._count(dropped=len(batch))
            return
        missing = [(key, value, due) for (key, value, due), renewed in zip(batch, held, strict=True)
                   if not renewed and value is not None]
        self._count(present=sum(1 for (_, value, _), renewed in zip(batch, held, strict=True)
                                if renewed and value is not None))
        if not missing:
            return
        sets = [("set", self.name(key), value, {"pxat": _ms(due)}) for key, value, due in missing]
        if self._round_trip(self.config.transfer_timeout_ms, sets) is None:
            self._count(dropped=len(missing))
            return
        self._count(writes=len(missing), bytes_out=sum(len(v) for _, v, _ in missing))

    def _poll_turnover(self) -> None:
        """Every `Turnover.poll_s`, read the server's count of evicted keys and of keys held."""
        now = time.monotonic()
        with self._lock:
            if not self.turnover.due(now):
                return
        counts = self._server_counts()
        if counts is None:
            return
        with self._lock:
            self.turnover.observe(now, *counts)

    def _server_counts(self) -> tuple[int, int] | None:
        """(keys evicted since the server started, keys held), summed over a cluster's primaries."""
        try:
            client = self._client(self.config.timeout_ms)
            if isinstance(client, RedisCluster):
                stats = client.info("stats", target_nodes=RedisCluster.PRIMARIES)
                evicted = sum(int(node["evicted_keys"]) for node in stats.values())
                keys = client.dbsize(target_nodes=RedisCluster.PRIMARIES)
            else:
                evicted = int(client.info("stats")["evicted_keys"])
                keys = client.dbsize()
        except (redis.RedisError, OSError, KeyError, TypeError, ValueError) as exc:
            log.debug("remote cache: no eviction counters: %s", exc)
            return None
        return evicted, int(keys)

    # -- books -----------------------------------------------------------------------------

    def _round_trip(self, timeout_ms: float, commands: list[tuple]) -> list | None:
        """Send `commands` (name, args..., optional keyword dict) in one pipeline; their answers, or
        None after a failure (counted, and reported to the breaker)."""
        t0 = time.perf_counter()
        try:
            # A cluster pipeline splits the commands by slot, one round trip per node.
            pipe = self._client(timeout_ms).pipeline(transaction=False)
            for name, *args in commands:
                kwargs = args.pop() if args and isinstance(args[-1], dict) else {}
                getattr(pipe, name)(*args, **kwargs)
            answers = pipe.execute()
        except (redis.RedisError, OSError) as exc:
            self._count(errors=1)
            self.breaker.failed(exc)
            return None
        seconds = time.perf_counter() - t0
        with self._lock:
            self._rtt[bisect.bisect_left(RTT_BUCKETS, seconds)] += 1
            self._rtt_sum += seconds
        self.breaker.succeeded()
        return answers

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def stats(self) -> RemoteStats:
        with self._lock:
            return RemoteStats(url=self.url, up=self.breaker.up, pending_bytes=self._pending_bytes,
                               rtt_counts=tuple(self._rtt), rtt_sum=self._rtt_sum,
                               turnover_s=self.turnover.value, **self._counts)

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued (up to `timeout`), stop the writer, close the connections."""
        self.flush(timeout)
        with self._cv:
            self._closing = True
            self._queue.clear()
            self._items.clear()  # nobody waits on a write that will not be sent
            self._cv.notify_all()
        self._writer.join(timeout)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()


def _ms(seconds: float) -> int:
    """Unix seconds as the milliseconds PXAT and PEXPIREAT take."""
    return int(seconds * 1000)
