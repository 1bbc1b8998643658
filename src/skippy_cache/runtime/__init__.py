"""The llama.cpp runtime: the engine, its lanes and the native calls the core's decisions need."""

from skippy_cache.diskchunks import CacheDirBusy
from skippy_cache.runtime.engine import Engine
from skippy_cache.runtime.gguf_info import GgufInfo, ModelNotFoundError, default_model_path, read_gguf_info
from skippy_cache.runtime.info import (
    EngineConfig,
    EngineInfo,
    EngineStats,
    PoolAudit,
    PoolView,
    available_cores,
)
from skippy_cache.runtime.logprobs import MAX_TOP_LOGPROBS, Logprob, TokenLogprobs
from skippy_cache.runtime.native import (
    KV_TYPES,
    PENALTY_LAST_N,
    FreeText,
    SamplingParams,
    apply_builtin_chat_template,
    builtin_chat_templates,
    json_grammar,
    literal_json_grammar,
)
from skippy_cache.runtime.prefixcache import Explanation, TenantFigures
from skippy_cache.runtime.remote import RTT_BUCKETS, RemoteConfig, RemoteStats, redact
from skippy_cache.runtime.requests import (
    Completion,
    DoneEvent,
    EngineClosedError,
    Event,
    FinishReason,
    GenerationRequest,
    Keep,
    QueueFullError,
    RequestError,
    RequestHandle,
    RequestStats,
    TokenEvent,
)
from skippy_cache.runtime.startup import StartupError
from skippy_cache.runtime.weightprobe import WeightLayout, WeightLayoutError

__all__ = [
    "KV_TYPES",
    "MAX_TOP_LOGPROBS",
    "PENALTY_LAST_N",
    "RTT_BUCKETS",
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
    "FreeText",
    "GenerationRequest",
    "GgufInfo",
    "Keep",
    "Logprob",
    "ModelNotFoundError",
    "PoolAudit",
    "PoolView",
    "QueueFullError",
    "RemoteConfig",
    "RemoteStats",
    "RequestError",
    "RequestHandle",
    "RequestStats",
    "SamplingParams",
    "StartupError",
    "TenantFigures",
    "TokenEvent",
    "TokenLogprobs",
    "WeightLayout",
    "WeightLayoutError",
    "apply_builtin_chat_template",
    "available_cores",
    "builtin_chat_templates",
    "default_model_path",
    "json_grammar",
    "literal_json_grammar",
    "read_gguf_info",
    "redact",
]
