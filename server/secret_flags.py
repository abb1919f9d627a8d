"""Secrets of `hicache serve` from a file (and the API key from the environment too), so that
they need not be on its command line (which every local user can read in /proc/PID/cmdline).

Each secret option (`SECRETS`: the API key, the L3 secret, the L3 extra config, which holds a
Redis URL's password) is taken from its flag (`--api-key`), else from the file its `-file` flag
names (`--api-key-file PATH`: the whole file, one trailing newline dropped; private to its owner
is best), else, for the API key only, from `HICACHE_API_KEY` (as OpenAI's and vLLM's clients and
servers read theirs), read when the command line is parsed. The flag and its file together are an
error. Errors name the flag or the file, never the value. The processes the server starts receive
the value over pipes and sockets, never in their arguments.
"""
from __future__ import annotations

import argparse
from typing import Mapping, NamedTuple


class Secret(NamedTuple):
    dest: str  # the config field, and the flag's dest
    env: str | None = None  # the environment variable read when neither the flag nor its file is given

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def file_dest(self) -> str:
        return self.dest + "_file"


SECRETS = (Secret("api_key", "HICACHE_API_KEY"),
           Secret("hicache_storage_secret"), Secret("hicache_storage_backend_extra_config"))


def add_secret_file_flags(parser: argparse.ArgumentParser) -> None:
    """`--<secret>-file PATH` for each of `SECRETS`, in a group of their own."""
    group = parser.add_argument_group("secrets from a file")
    for s in SECRETS:
        env = f" Neither given: ${s.env}, if set." if s.env else ""
        group.add_argument(s.flag + "-file", dest=s.file_dest, metavar="PATH", default=None,
                           help=f"Read {s.flag} from this file (the whole file, a trailing newline dropped) "
                                f"instead of the command line.{env}")


def resolve_secrets(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """Sets each secret of `args` that its flag does not give from its file or `environ`
    (ValueError naming the flag or the file, never the value)."""
    for s in SECRETS:
        given, path = getattr(args, s.dest, None), getattr(args, s.file_dest, None)
        if path is not None and given is not None:
            raise ValueError(f"give {s.flag} or {s.flag}-file, not both")
        if path is not None:
            setattr(args, s.dest, read_secret_file(path, s.flag + "-file"))
        elif given is None and s.env is not None and environ.get(s.env):
            setattr(args, s.dest, environ[s.env])


def read_secret_file(path: str, flag: str) -> str:
    """The secret in the file at `path` (a trailing newline dropped); ValueError if it cannot be
    read or is empty."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag}: cannot read {path}: {getattr(e, 'strerror', None) or type(e).__name__}") from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise ValueError(f"{flag}: {path} is empty")
    return text

