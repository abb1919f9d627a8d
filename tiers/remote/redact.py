"""Credentials out of whatever the server shows or logs about its L3 backend.

`redact(text)` masks the password of every URL in `text` (`redis://user:pass@host` ->
`redis://user:***@host`, `redis://:pass@host` -> `redis://:***@host`) and `password=` query
parameters, plus any literal `secrets` given (a backend passes its own password, so that a
message that quotes it without its URL is masked too). `redact_obj` does the same through the
strings of a JSON-like value (the server's config and stats: the extra config's `url`). Standard
library only: the server imports it through `hicache.runtime.redact`.
"""
from __future__ import annotations

import re
from typing import Iterable
from urllib.parse import quote, unquote

MASK = "***"
# scheme://user:password@ -- the password runs to the authority's last "@" (as urlparse splits it)
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^:/?#@\s\"'<>]*:)[^/?#\s\"'<>]*(?=@)")
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&;](?:password|passwd|pwd|token|secret)=)[^&;#\s\"'<>]*", re.IGNORECASE)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with URL passwords, password query parameters and the literal `secrets` masked."""
    text = _URL_PASSWORD.sub(lambda m: m["head"] + MASK, text)
    text = _QUERY_PASSWORD.sub(lambda m: m["head"] + MASK, text)
    for secret in secrets:
        if not secret:
            continue
        for form in {secret, quote(secret, safe=""), unquote(secret)}:
            text = text.replace(form, MASK)
    return text


def url_password(url: str) -> str | None:
    """The password part of a URL (percent-decoded), or None: for `redact`'s `secrets`."""
    m = re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^:/?#@]*:([^/?#]*)@", url)
    return unquote(m.group(1)) if m and m.group(1) else None


def redact_obj(value, secrets: Iterable[str] = ()):
    """A copy of a JSON-like value (dicts, lists, strings, numbers) with every string redacted."""
    secrets = tuple(secrets)
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, dict):
        return {k: redact_obj(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_obj(v, secrets) for v in value]
    return value
