"""The `skippy-cache` command line."""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    from skippy_cache.server.settings import add_arguments, options_summary

    parser = argparse.ArgumentParser(
        prog="skippy-cache",
        description="Exact, resident prefix KV reuse for llama.cpp serving.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "serve options (command line > SKIPPY_* environment > --config TOML file > defaults):\n"
            f"{options_summary()}\n\n"
            "Example: skippy-cache serve --port 8000 --ctx-size 8192 --lanes 4"
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description=(
            "Run the OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, "
            "/v1/cache, /health, /metrics). Each option can also come from its SKIPPY_* environment "
            "variable or a TOML file (--config); the command line wins, then the environment, then the file."
        ),
    )
    add_arguments(serve)
    # The bench's own options live in skippy_cache.bench.cli and are parsed there, so the bench
    # (rich, matplotlib, httpx: the `bench` extra) is imported only when `bench` runs; `main`
    # hands it the arguments this parser leaves over.
    sub.add_parser(
        "bench",
        add_help=False,
        help="benchmark skippy-cache against llama-cpp-python / any OpenAI-compatible server "
        "(needs the 'bench' extra; `skippy-cache bench --help` for options)",
    )
    sub.add_parser(
        "replay",
        add_help=False,
        help="replay a Mooncake-format trace through the cache's tiers, no model loaded: hit ratios per tier "
        "for given capacities, replicas and eviction policy (`skippy-cache replay --help` for options)",
    )
    hash_key = sub.add_parser(
        "hash-key",
        help="make a line of an --api-keys file: a new key (or one given) and its hash",
        description=(
            "Print a line for an --api-keys file: the key's SHA-256 hash, the tenant, the role and its options. "
            "Without KEY a new random key is made and printed on stderr (give it to the client; "
            "only its hash goes in the file), so 'skippy-cache hash-key --tenant alice >> keys.txt' "
            "appends the line and shows the key once."
        ),
    )
    hash_key.add_argument("key", nargs="?", help="the key to hash ('-': read it from stdin; default: a new one)")
    hash_key.add_argument("--tenant", required=True, help="the tenant the key names")
    hash_key.add_argument("--role", choices=("user", "admin"), default="user", help="user (default) or admin")
    hash_key.add_argument("--shared", default="", help="shared namespaces the key may join, comma-separated")
    hash_key.add_argument("--store", choices=("all", "ram", "none"), default="all",
                          help="where the tenant's entries may go when they leave the pool: all (default), ram "
                          "(never disk or the shared tier), none")
    demo = sub.add_parser("demo", help="print the cache budgets and prefix lengths the core derives")
    demo.add_argument("--ctx-size", type=int, default=8192, help="KV cells in the context (default 8192)")
    demo.add_argument(
        "--prompt-tokens", type=int, default=2214, help="prompt length in tokens (default 2214)"
    )
    demo.add_argument("--lanes", type=int, default=4, help="execution lanes (default 4)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        try:
            from skippy_cache.bench.cli import main as bench_main
        except ImportError as exc:
            parser.exit(1, f"skippy-cache bench: error: {exc}; needs the extra: pip install -e '.[bench]'\n")
        return bench_main(rest)
    if args.command == "replay":
        from skippy_cache.sizing.cli import main as replay_main

        return replay_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    if args.command == "hash-key":
        from skippy_cache.server.tenants import KeyFileError, hash_key, new_key, parse_key_file

        key = args.key
        if key == "-":
            key = sys.stdin.readline().strip()
        elif key is None:
            key = new_key()
        if not key:
            parser.error("the key is empty")
        options = [f"shared={args.shared}" if args.shared else "", f"store={args.store}" if args.store != "all" else ""]
        line = " ".join(filter(None, [hash_key(key), args.tenant, args.role, *options]))
        try:
            parse_key_file(line, "hash-key")  # the server's own check: what it would refuse is not printed
        except KeyFileError as exc:
            parser.error(str(exc))
        if args.key is None:
            print(f"key: {key}", file=sys.stderr)
        print(line)
        return 0

    if args.command == "demo":
        from skippy_cache.demo import run_demo

        print(run_demo(args.ctx_size, args.prompt_tokens, args.lanes))
        return 0

    if args.command == "serve":
        from skippy_cache.diskchunks import CacheDirBusy
        from skippy_cache.runtime.startup import StartupError
        from skippy_cache.server.serve import serve
        from skippy_cache.server.settings import SettingsError, load_settings

        try:
            settings = load_settings(args)
        except SettingsError as exc:
            parser.exit(2, f"skippy-cache serve: error: {exc}\n")
        logging.basicConfig(
            level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        try:
            return serve(settings)
        except (SettingsError, StartupError, CacheDirBusy) as exc:
            # A setting or file the user gave: one line that names it, no traceback.
            parser.exit(2, f"skippy-cache serve: error: {exc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
