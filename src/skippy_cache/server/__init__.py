"""The OpenAI-compatible HTTP server over the runtime engine."""

from skippy_cache.server.app import create_app
from skippy_cache.server.chat import ChatFormatter
from skippy_cache.server.serve import serve, startup_report
from skippy_cache.server.settings import ServerSettings, SettingsError, load_settings

__all__ = [
    "ChatFormatter",
    "ServerSettings",
    "SettingsError",
    "create_app",
    "load_settings",
    "serve",
    "startup_report",
]
