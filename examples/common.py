"""What every example shares: where its programs run (`--url` of a running `hicache serve`, or an
in-process Engine on the default model)."""
from __future__ import annotations

import argparse

import hicache.lang as sgl


def backend_from_args(description: str) -> argparse.Namespace:
    """Parse --url / --api-key / --max-tokens and make the chosen backend the default one."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", help="a running `hicache serve`, e.g. http://127.0.0.1:30000 "
                        "(default: an in-process Engine)")
    parser.add_argument("--api-key", help="the server's --api-key")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per generation")
    args = parser.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url, api_key=args.api_key) if args.url else sgl.Engine())
    return args
