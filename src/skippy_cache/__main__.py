"""The `skippy-cache` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="skippy-cache",
        description="Exact, resident prefix KV reuse for llama.cpp serving.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="print the cache budgets and prefix lengths the core derives")
    demo.add_argument("--ctx-size", type=int, default=8192, help="KV cells in the context (default 8192)")
    demo.add_argument("--prompt-tokens", type=int, default=2214, help="prompt length in tokens (default 2214)")
    demo.add_argument("--lanes", type=int, default=4, help="execution lanes (default 4)")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from skippy_cache.demo import run_demo

        print(run_demo(args.ctx_size, args.prompt_tokens, args.lanes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
