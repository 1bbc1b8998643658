"""llama-cpp-python's server with llama.cpp's weight repacking off: `python -m skippy_cache.bench.plainpeer ARGS`.

The server takes `python -m llama_cpp.server`'s arguments but has no setting for repacking
(llama-server's `--no-repack`), and `Llama` always loads with llama.cpp's default, which repacks.
The bench starts it this way whenever skippy-cache loads plain weights (targets.py), so both run
the same matmul kernels; on a CPU where AMX repacking faults, the peer then answers too.
"""

from __future__ import annotations

import llama_cpp.llama_cpp as native
from llama_cpp.server.__main__ import main as serve

_default_params = native.llama_model_default_params


def _plain_weight_params() -> native.llama_model_params:
    params = _default_params()
    params.use_extra_bufts = False
    return params


def main() -> None:
    # `Llama.__init__` reads its model parameters from this function, once per model load.
    native.llama_model_default_params = _plain_weight_params
    serve()


if __name__ == "__main__":
    main()
