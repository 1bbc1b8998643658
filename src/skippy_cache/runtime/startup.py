"""Start-up failures a user can cause: a setting or file the engine cannot start with.

Each is one line that names the setting, the value and what to do; the CLI
prints it and exits 2, never with a traceback.
"""

from __future__ import annotations


class StartupError(RuntimeError):
    """The engine cannot start with what it was given; the message says which setting and what to do."""
