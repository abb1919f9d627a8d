"""The `hicache` command: `hicache serve` (HTTP server) and `hicache stats` (per-tier cache stats).

`serve` flags are generated from the config dataclasses (`RuntimeConfig`, `HiCacheConfig`,
`ServerConfig`): SGLang's flag names, defaults and help written once, in those dataclasses; the
secrets among them may come from a file or the environment instead (`secret_flags.py`).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from hicache.config import HiCacheConfig
from hicache.runtime.config import RuntimeConfig
from hicache.server.config import ServerConfig
from hicache.server.flags import add_dataclass_flags, config_from_args
from hicache.server.secret_flags import add_secret_file_flags, resolve_secrets

DEFAULT_URL = "http://127.0.0.1:30000"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description="A hierarchical-cache-first LLM serving engine.")
    sub = parser.add_subparsers(dest="command", metavar="{serve,stats}")
    sub.required = True
    serve = sub.add_parser("serve", help="Serve a model over HTTP (OpenAI-compatible and SGLang-native APIs).",
                           description="Serve a model over HTTP. With no --model-path: the embedded "
                                       "SmolLM2-135M-Instruct.")
    add_serve_flags(serve)
    stats = sub.add_parser("stats", help="Show per-tier KV cache statistics of a running server.")
    stats.add_argument("--url", action="append", default=None,
                       help=f"Server base URL (default: $HICACHE_URL or {DEFAULT_URL}); repeat it for several "
                            "replicas: each one's stats, then the total.")
    stats.add_argument("--watch", type=float, metavar="SECONDS", default=None,
                       help="Refresh every SECONDS until Ctrl-C.")
    stats.add_argument("--json", action="store_true", help="Print the raw JSON instead of tables.")
    stats.add_argument("--api-key", default=os.environ.get("HICACHE_API_KEY"),
                       help="Bearer key, if the server was started with --api-key (default: $HICACHE_API_KEY).")
    return parser


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `hicache serve`, a group per config dataclass."""
    add_dataclass_flags(parser, ServerConfig, "server")
    add_dataclass_flags(parser, RuntimeConfig, "model and scheduling")
    add_dataclass_flags(parser, HiCacheConfig, "KV cache")
    add_secret_file_flags(parser)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "stats":
        from hicache.server import stats_cli

        if args.watch is not None and args.watch <= 0:
            print("hicache stats: --watch must be > 0 seconds", file=sys.stderr)
            return 2
        urls = args.url or [os.environ.get("HICACHE_URL", DEFAULT_URL)]
        return stats_cli.run(urls, args.watch, args.json, args.api_key)
    return _serve(args)


def serve_configs(args: argparse.Namespace) -> tuple[ServerConfig, RuntimeConfig, HiCacheConfig]:
    """The configs of `hicache serve`, the secrets the flags do not give read from their files or
    the environment now (ValueError or TypeError on a bad value)."""
    resolve_secrets(args, os.environ)
    server, runtime = config_from_args(ServerConfig, args), config_from_args(RuntimeConfig, args)
    if runtime.disaggregation_mode != "null" and server.dp_size > 1:
        raise ValueError("disaggregation_mode: not supported with dp_size > 1 yet (one bootstrap server per server)")
    if runtime.disaggregation_bootstrap_host is None:  # the bootstrap server binds where the HTTP server does
        runtime = replace(runtime, disaggregation_bootstrap_host=server.host)
    return server, runtime, config_from_args(HiCacheConfig, args)


def _serve(args: argparse.Namespace) -> int:
    try:
        server, runtime, cache = serve_configs(args)
    except (TypeError, ValueError) as e:
        print(f"hicache serve: {e}", file=sys.stderr)
        return 2
    from hicache.server import launch

    return launch.run(server, runtime, cache)


if __name__ == "__main__":
    sys.exit(main())
