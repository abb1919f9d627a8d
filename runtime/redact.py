"""`redact` and `redact_obj` (`hicache.tiers.remote.redact`) for the server, whose imports reach the
tiers only through the runtime (tests/test_import_direction.py)."""
from __future__ import annotations

from hicache.tiers.remote.redact import MASK, redact, redact_obj, url_password

__all__ = ["MASK", "redact", "redact_obj", "url_password"]
