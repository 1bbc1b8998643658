"""The llama.cpp runtime: the engine, its lanes and the native calls the core's decisions need."""

from skippy_cache.diskchunks import CacheDirBusy
from skippy_cache.runtime.engine import Engine
from skippy_cache.runtime.info import EngineConfig, EngineInfo, EngineStats, PoolAudit, PoolView, available_cores
from skippy_cache.runtime.gguf_info import GgufInfo, ModelNotFoundError, default_model_path, read_gguf_info
from skippy_cache.runtime.native import SamplingParams
from skippy_cache.runtime.prefixcache import Explanation
from skippy_cache.runtime.remote import RTT_BUCKETS, RemoteConfig, RemoteStats, redact
from skippy_cache.runtime.requests import (
    Completion,
    DoneEvent,
    EngineClosedError,
    Event,
    FinishReason,
    GenerationRequest,
    QueueFullError,
    RequestError,
    RequestHandle,
    RequestStats,
    TokenEvent,
)

__all__ = [
    "CacheDirBusy",
    "Completion",
    "DoneEvent",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineInfo",
    "EngineStats",
    "Event",
    "Explanation",
    "FinishReason",
    "GenerationRequest",
    "GgufInfo",
    "ModelNotFoundError",
    "PoolAudit",
    "PoolView",
    "QueueFullError",
    "RTT_BUCKETS",
    "RemoteConfig",
    "RemoteStats",
    "RequestError",
    "RequestHandle",
    "RequestStats",
    "SamplingParams",
    "TokenEvent",
    "available_cores",
    "default_model_path",
    "read_gguf_info",
    "redact",
]
