"""Which `model` names a request may use.

One model is loaded; by default it answers any name, as llama-server and
llama-cpp-python's server do: many clients are configured with a name such
as `gpt-4o-mini` and cannot be told otherwise. Responses always report the
name served (the model's id). With `--strict-model-names` a name other than
the id or the alias is a 404 `model_not_found`.
"""

from __future__ import annotations

import logging

from skippy_cache.server.errors import APIError

log = logging.getLogger("skippy_cache.server")

#: Unknown names logged at most this many times in all: a client sending a
#: fresh name per request must not grow a set (or the log) without bound.
MAX_LOGGED_NAMES = 64


class ModelNames:
    def __init__(self, served: str, alias: str, *, strict: bool) -> None:
        #: The model's id: what responses report.
        self.served = served
        #: The names that are ours: the id, then the alias.
        self.names = tuple(dict.fromkeys((served, alias)))
        self.strict = strict
        #: Unknown names already logged (event loop only; bounded by MAX_LOGGED_NAMES).
        self._logged: set[str] = set()

    def check(self, name: str | None) -> None:
        """Accept `name` (None: not given) or raise the 404 of strict mode; log a new unknown name once."""
        if not name or name in self.names:
            return
        if self.strict:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.served}`",
                param="model",
                code="model_not_found",
            )
        if name in self._logged or len(self._logged) > MAX_LOGGED_NAMES:
            return
        self._logged.add(name)
        if len(self._logged) > MAX_LOGGED_NAMES:
            log.info("requests name more than %d other models; no longer logging new names", MAX_LOGGED_NAMES)
        else:
            log.info("a request names model %r: serving %r (--strict-model-names refuses other names)",
                     name[:200], self.served)
