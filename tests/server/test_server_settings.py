"""Settings: CLI > SKIPPY_* environment > TOML file > defaults; malformed values name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from skippy_cache.__main__ import build_parser
from skippy_cache.config import CacheMode
from skippy_cache.eviction import Policy
from skippy_cache.runtime import EngineConfig
from skippy_cache.server.settings import (
    OPTIONS,
    ServerSettings,
    SettingsError,
    default_cache_dir,
    load_settings,
)
from skippy_cache.weights import WeightRepack

MIB = 1024 * 1024


def settings(argv: list[str], env: dict[str, str] | None = None) -> ServerSettings:
    args = build_parser().parse_args(["serve", *argv])
    return load_settings(args, env or {})


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "skippy.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = settings([])
    # A server keeps its store on disk, in the user's cache directory, unless told otherwise.
    assert s.cache_dir == Path.home() / ".cache" / "skippy-cache"
    assert s == ServerSettings(cache_dir=s.cache_dir)
    assert (s.host, s.port, s.ctx_size, s.lanes) == ("127.0.0.1", 8000, 8192, 4)
    assert (s.queue_size, s.api_key) == (64, None)
    assert s.cache.mode is CacheMode.AUTO and s.cache.min_tokens == 64
    assert (s.host_cache_mib, s.idle_tokens, s.disk_cache_mib, s.chunk_tokens) == (None, 256, 10240, 64)
    engine = s.engine_config()
    # RAM tier: None lets the engine size it from the machine, as it does by default.
    assert (engine.host_cache_bytes, engine.idle_tokens) == (None, 256)
    assert engine.host_cache_bytes == EngineConfig().host_cache_bytes
    assert (engine.cache_dir, engine.disk_cache_bytes, engine.chunk_tokens) == (s.cache_dir, 10240 * MIB, 64)


def test_store_options(tmp_path: Path) -> None:
    s = settings(["--cache-dir", str(tmp_path), "--disk-cache-mib", "100", "--chunk-tokens", "512"])
    assert (s.cache_dir, s.disk_cache_mib, s.chunk_tokens) == (tmp_path, 100, 512)
    assert s.engine_config().disk_cache_bytes == 100 * MIB
    assert settings(["--cache-dir", "none"]).cache_dir is None
    assert settings([], {"SKIPPY_CACHE_DIR": "off"}).engine_config().cache_dir is None
    assert settings([], {"XDG_CACHE_HOME": str(tmp_path)}).cache_dir == tmp_path / "skippy-cache"
    assert default_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/skippy-cache")
    path = write(tmp_path, f"cache_dir = '{tmp_path}/d'\nchunk_tokens = 128\n")
    s = settings(["--config", str(path)])
    assert (s.cache_dir, s.chunk_tokens) == (tmp_path / "d", 128)
    with pytest.raises(SettingsError, match=r"--chunk-tokens=100 must be a multiple of 64"):
        settings(["--chunk-tokens", "100"])


def test_the_eviction_policy_from_cli_env_and_file(tmp_path: Path) -> None:
    assert settings([]).engine_config().eviction is Policy.LRFU
    assert settings(["--eviction", "lru"]).engine_config().eviction is Policy.LRU
    assert settings([], {"SKIPPY_EVICTION": "LRU"}).eviction is Policy.LRU
    assert settings(["--config", str(write(tmp_path, "eviction = 'lru'\n"))]).eviction is Policy.LRU
    with pytest.raises(SettingsError, match=r"--eviction='fifo' is not an eviction policy \(one of: lru, lrfu\)"):
        settings(["--eviction", "fifo"])


def test_weight_repack_from_cli_env_and_file(tmp_path: Path) -> None:
    assert settings([]).engine_config().weight_repack is WeightRepack.AUTO
    assert settings(["--weight-repack", "off"]).engine_config().weight_repack is WeightRepack.OFF
    assert settings([], {"SKIPPY_WEIGHT_REPACK": "ON"}).weight_repack is WeightRepack.ON
    path = write(tmp_path, "weight_repack = 'off'\n")
    assert settings(["--config", str(path)]).weight_repack is WeightRepack.OFF
    assert settings(["--config", str(path), "--weight-repack", "auto"]).weight_repack is WeightRepack.AUTO
    with pytest.raises(SettingsError, match=r"SKIPPY_WEIGHT_REPACK='amx' is not a weight repack setting"):
        settings([], {"SKIPPY_WEIGHT_REPACK": "amx"})


def test_kv_cache_types_from_cli_env_and_file(tmp_path: Path) -> None:
    default = settings([]).engine_config()
    assert (default.type_k, default.type_v) == ("f16", "f16")
    chosen = settings(["--cache-type-k", "q8_0", "--cache-type-v", "Q4_0"]).engine_config()
    assert (chosen.type_k, chosen.type_v) == ("q8_0", "q4_0")
    assert settings([], {"SKIPPY_CACHE_TYPE_V": "q8_0"}).cache_type_v == "q8_0"
    path = write(tmp_path, "cache_type_k = 'q5_1'\n")
    assert settings(["--config", str(path)]).cache_type_k == "q5_1"
    with pytest.raises(SettingsError, match=r"--cache-type-k='q3_k': a KV cache type is one of f32, f16, q8_0"):
        settings(["--cache-type-k", "q3_k"])


def test_shared_tier_options(tmp_path: Path) -> None:
    assert settings([]).engine_config().remote is None  # off by default: no server to start
    s = settings(["--remote-cache", "redis://cache:6379/2", "--remote-cache-ttl", "600",
                  "--remote-cache-timeout-ms", "20"])
    remote = s.engine_config().remote
    assert remote is not None
    assert (remote.url, remote.ttl_s, remote.timeout_ms, remote.password) == ("redis://cache:6379/2", 600, 20, None)
    password = tmp_path / "pw"
    password.write_text("hunter2\nignored\n")
    env = {"SKIPPY_REMOTE_CACHE": "rediss://cache:6380/0", "SKIPPY_REMOTE_CACHE_PASSWORD_FILE": str(password)}
    remote = settings([], env).engine_config().remote
    assert remote is not None and (remote.url, remote.password) == ("rediss://cache:6380/0", "hunter2")
    path = write(tmp_path, "remote_cache = 'unix:///run/redis.sock'\nremote_cache_ttl = 60\n")
    remote = settings(["--config", str(path)]).engine_config().remote
    assert remote is not None and (remote.url, remote.ttl_s) == ("unix:///run/redis.sock", 60)
    assert settings(["--remote-cache", "none"]).remote_cache is None
    # A URL with a password in it never shows in a message or a repr.
    with pytest.raises(SettingsError, match="redis://, rediss:// or unix://") as raised:
        settings(["--remote-cache", "http://user:hunter2@cache:6379"])
    assert "hunter2" not in str(raised.value)
    assert "hunter2" not in repr(settings(["--remote-cache", "redis://u:hunter2@cache:6379/0"]))
    missing = settings(["--remote-cache", "redis://c:1/0", "--remote-cache-password-file", str(tmp_path / "no")])
    with pytest.raises(SettingsError, match="--remote-cache-password-file"):
        missing.engine_config()


def test_cli_options_map_to_settings() -> None:
    s = settings([
        "--model", "/m.gguf", "--host", "0.0.0.0", "--port", "9000", "--ctx-size", "4096", "--lanes", "2",
        "--cache-mode", "off", "--max-entries", "10", "--max-bytes", "1_000_000", "--min-tokens", "32",
        "--stride", "64", "--record-limit", "0", "--api-key", "k", "--queue-size", "3", "--fast",
    ])
    assert str(s.model) == "/m.gguf" and s.host == "0.0.0.0" and s.port == 9000
    assert (s.ctx_size, s.lanes, s.api_key, s.queue_size, s.fast) == (4096, 2, "k", 3, True)
    c = s.cache
    assert c.mode is CacheMode.DISABLED
    assert (c.max_entries, c.max_bytes, c.min_tokens) == (10, 1_000_000, 32)
    assert (c.shared_prefix_stride_tokens, c.shared_prefix_record_limit) == (64, 0)
    engine = s.engine_config()
    assert (engine.ctx_size, engine.lanes, engine.max_queue, engine.deterministic) == (4096, 2, 3, False)
    assert settings([]).engine_config().deterministic  # exact mode unless told otherwise
    assert engine.cache == c


def test_environment_including_the_cores_cache_variables() -> None:
    env = {"SKIPPY_PORT": "8123", "SKIPPY_FAST": "yes", "SKIPPY_KV_CACHE": "record",
           "SKIPPY_KV_CACHE_MIN_TOKENS": "16", "SKIPPY_KV_CACHE_SHARED_STRIDE_TOKENS": "32"}
    s = settings([], env)
    assert s.port == 8123 and s.fast is True
    assert s.cache.mode is CacheMode.RECORD
    assert (s.cache.min_tokens, s.cache.shared_prefix_stride_tokens) == (16, 32)


def test_precedence_cli_over_env_over_file(tmp_path: Path) -> None:
    toml = "port = 7000\nlanes = 3\nctx_size = 1024\n[cache]\nmin_tokens = 8\nmax_entries = 5\n"
    path = write(tmp_path, toml)
    env = {"SKIPPY_CONFIG": str(path), "SKIPPY_PORT": "7100", "SKIPPY_KV_CACHE_MIN_TOKENS": "12"}
    s = settings(["--port", "7200"], env)
    assert s.port == 7200  # CLI over env over file
    assert s.cache.min_tokens == 12  # env over file
    assert (s.lanes, s.ctx_size, s.cache.max_entries) == (3, 1024, 5)  # file over defaults
    assert settings(["--config", str(path)]).port == 7000


def test_host_tier_options_from_cli_env_and_file(tmp_path: Path) -> None:
    s = settings(["--host-cache-mib", "512", "--idle-tokens", "1_000"])
    assert (s.host_cache_mib, s.idle_tokens) == (512, 1000)
    engine = s.engine_config()
    assert (engine.host_cache_bytes, engine.idle_tokens) == (512 * MIB, 1000)

    s = settings([], {"SKIPPY_HOST_CACHE_MIB": "64", "SKIPPY_IDLE_TOKENS": "32"})
    assert (s.engine_config().host_cache_bytes, s.engine_config().idle_tokens) == (64 * MIB, 32)

    # Top-level TOML keys (not in [cache]); 0 turns the tier off / idle demotion off.
    path = write(tmp_path, "host_cache_mib = 0\nidle_tokens = 0\n")
    s = settings(["--config", str(path)])
    assert (s.host_cache_mib, s.idle_tokens) == (0, 0)
    assert (s.engine_config().host_cache_bytes, s.engine_config().idle_tokens) == (0, 0)

    # CLI over env over file.
    path = write(tmp_path, "host_cache_mib = 100\nidle_tokens = 10\n")
    env = {"SKIPPY_CONFIG": str(path), "SKIPPY_HOST_CACHE_MIB": "200"}
    s = settings(["--idle-tokens", "30"], env)
    assert (s.host_cache_mib, s.idle_tokens) == (200, 30)
    assert settings([], {"SKIPPY_CONFIG": str(path)}).idle_tokens == 10
    # A large budget is not truncated on the way to bytes.
    assert settings(["--host-cache-mib", "65536"]).engine_config().host_cache_bytes == 64 << 30


def test_file_types_are_checked(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="fast"):
        settings(["--config", str(write(tmp_path, 'fast = "maybe"\n'))])
    with pytest.raises(SettingsError, match="unknown setting 'ctx'"):
        settings(["--config", str(write(tmp_path, "ctx = 5\n"))])
    with pytest.raises(SettingsError, match="not valid TOML"):
        settings(["--config", str(write(tmp_path, "port = \n"))])
    with pytest.raises(SettingsError, match=r"skippy.toml: host_cache_mib=-2 must be at least 0"):
        settings(["--config", str(write(tmp_path, "host_cache_mib = -2\n"))])
    with pytest.raises(SettingsError, match=r"skippy.toml: idle_tokens='1.5' is not an integer"):
        settings(["--config", str(write(tmp_path, "idle_tokens = 1.5\n"))])
    with pytest.raises(SettingsError, match=r"skippy.toml: max_queue_wait=\[1\] must be a string or a number"):
        settings(["--config", str(write(tmp_path, "max_queue_wait = [1]\n"))])
    assert settings(["--config", str(write(tmp_path, "max_queue_wait = 2.5\n"))]).max_queue_wait == 2.5
    with pytest.raises(SettingsError, match=r"--max-queue-wait=-1 must be 0 or more seconds"):
        settings(["--max-queue-wait", "-1"])
    with pytest.raises(SettingsError, match=r"unknown setting 'cache.host_cache_mib'"):
        settings(["--config", str(write(tmp_path, "[cache]\nhost_cache_mib = 1\n"))])
    with pytest.raises(SettingsError, match="not found"):
        settings(["--config", str(tmp_path / "missing.toml")])


@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (["--port", "eighty"], {}, "--port"),
        (["--port", "70000"], {}, "--port"),
        (["--lanes", "0"], {}, "--lanes"),
        (["--cache-mode", "sometimes"], {}, "--cache-mode"),
        ([], {"SKIPPY_CTX_SIZE": "big"}, "SKIPPY_CTX_SIZE"),
        ([], {"SKIPPY_FAST": "perhaps"}, "SKIPPY_FAST"),
        ([], {"SKIPPY_KV_CACHE_MAX_ENTRIES": "-3"}, "SKIPPY_KV_CACHE_MAX_ENTRIES"),
        ([], {"SKIPPY_KV_CACHE": "sometimes"}, "SKIPPY_KV_CACHE"),
        (["--host-cache-mib", "-1"], {}, r"--host-cache-mib=-1 must be at least 0"),
        (["--host-cache-mib", "2GiB"], {}, r"--host-cache-mib='2GiB' is not an integer"),
        (["--idle-tokens", "-5"], {}, r"--idle-tokens=-5 must be at least 0"),
        ([], {"SKIPPY_HOST_CACHE_MIB": "lots"}, r"SKIPPY_HOST_CACHE_MIB='lots' is not an integer"),
        ([], {"SKIPPY_IDLE_TOKENS": "1.5"}, r"SKIPPY_IDLE_TOKENS='1.5' is not an integer"),
    ],
)
def test_malformed_values_name_the_setting(argv: list[str], env: dict[str, str], names: str) -> None:
    with pytest.raises(SettingsError, match=names):
        settings(argv, env)


def test_every_option_has_help_and_a_distinct_env_and_flag() -> None:
    assert len({o.env for o in OPTIONS}) == len(OPTIONS)
    assert len({o.flag for o in OPTIONS}) == len(OPTIONS)
    help_text = build_parser().format_help()
    for option in OPTIONS:
        assert option.flag in help_text and option.env in help_text and option.help
