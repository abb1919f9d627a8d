"""`ServerConfig`: the HTTP front end's options. CLI defaults are read from here."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from hicache.server.routing import METHODS as LOAD_BALANCE_METHODS
from hicache.server.tools import FORMATS as TOOL_CALL_FORMATS


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "Address to bind; 0.0.0.0 exposes the server to the network."})
    port: int = field(default=30000, metadata={"help": "TCP port to listen on."})
    api_key: str | None = field(default=None, repr=False, metadata={"help": "Require 'Authorization: Bearer <key>' on every route but /health. On a shared machine give it with --api-key-file or $HICACHE_API_KEY: the command line is visible to every local user."})
    served_model_name: tuple[str, ...] = field(default=(), metadata={"help": "Model names (one or more, space-separated) that requests may name, besides --model-path as given; the first is the name responses report. Default: the model's own name."})
    max_request_bytes: int = field(default=16 * 1024 * 1024, metadata={"help": "Largest accepted request body in bytes (413 beyond)."})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error."})
    startup_timeout: float = field(default=900.0, metadata={"help": "Seconds to wait for the scheduler process (each replica's) to load the model and warm up."})
    skip_server_warmup: bool = field(default=False, metadata={"help": "Serve without the warm-up request at start (one short greedy request through prefill and decode, so that the GPU kernels compile before the first user request: FlashInfer's first use takes minutes). It caches nothing and counts in no statistic."})
    graceful_shutdown_timeout: float = field(default=5.0, metadata={"help": "On SIGTERM, seconds in-flight requests get to finish before they are failed."})
    allowed_origins: str | None = field(default=None, metadata={"help": "Comma-separated origins (scheme://host[:port]) whose web pages may call the API from a browser (CORS), or '*' for any; default: none, and no CORS headers are sent."})
    allowed_hosts: str | None = field(default=None, metadata={"help": "Comma-separated host names (the Host header, port ignored) the server answers, or '*' for any; others get 400, which stops DNS-rebinding pages from reaching a local server. Default: the loopback names (localhost, 127.0.0.1, ::1) when bound to a loopback address, any host otherwise."})
    request_read_timeout: float = field(default=30.0, metadata={"help": "Seconds a client gets to send a request's headers (from its first byte, or from connecting) and, again, its body; then the server answers 408 and closes the connection."})
    tool_call_parser: str | None = field(default=None, metadata={"help": "How tool calls look in the model's output: hermes (<tool_call>{...}</tool_call>) or llama3 (a bare JSON object); default: detected from the chat template (hermes when it says nothing)."})
    response_write_timeout: float = field(default=60.0, metadata={"help": "Seconds one write of a response may wait for a client that stops reading it (a stalled stream); then its requests are aborted and the connection closed."})
    dp_size: int = field(default=1, metadata={"help": "Data-parallel replicas: scheduler processes behind this one HTTP process, each with its own model copy, L1 and L2; they share the L3 tier (an LMDB path, Redis, Mooncake; the memory backend is per replica). Sizes (--max-total-tokens, --mem-fraction-static, --hicache-size) are per replica; replica i runs on GPU i modulo the visible GPUs."})
    load_balance_method: str = field(default="cache_aware", metadata={"help": "How requests are spread over the --dp-size replicas: cache_aware (to the replica that served the longest prefix of the prompt, unless the loads are imbalanced) or round_robin."})
    cache_threshold: float = field(default=0.3, metadata={"help": "cache_aware: a request goes to the replica with the longest cached prefix when that covers more than this fraction of its prompt; otherwise to the replica with the most room."})
    balance_abs_threshold: int = field(default=64, metadata={"help": "cache_aware: the loads (requests in flight) count as imbalanced, and a request goes to the least loaded replica, when the largest exceeds the smallest by more than this ..."})
    balance_rel_threshold: float = field(default=1.5, metadata={"help": "... and is more than this many times the smallest."})
    max_tree_size: int = field(default=0, metadata={"help": "cache_aware: tokens of recent prompts the router remembers per replica (least recently used forgotten first); 0: as many as the replica's L1 and L2 hold."})
    restart_scheduler: bool = field(default=False, metadata={"help": "When a scheduler process dies (a replica's, under --dp-size), fail its in-flight requests and start a new one (the L3 tier survives; the other replicas serve meanwhile, and with one replica requests get 503 until it is ready). Without it the server fails them and exits with code 3, for its supervisor to restart."})

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):  # one name given as a plain string
            object.__setattr__(self, "served_model_name", (self.served_model_name,))
        if any(not name for name in self.served_model_name):
            raise ValueError("served_model_name: a model name must not be empty")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        if not self.request_read_timeout > 0:
            raise ValueError(f"request_read_timeout must be > 0 seconds, got {self.request_read_timeout}")
        if self.tool_call_parser not in (None, *TOOL_CALL_FORMATS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_FORMATS)}, got {self.tool_call_parser!r}")
        if not self.response_write_timeout > 0:
            raise ValueError(f"response_write_timeout must be > 0 seconds, got {self.response_write_timeout}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load_balance_method must be one of {', '.join(LOAD_BALANCE_METHODS)}, "
                             f"got {self.load_balance_method!r}")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1 or self.max_tree_size < 0:
            raise ValueError("balance_abs_threshold and max_tree_size must be >= 0 and balance_rel_threshold >= 1, got "
                             f"{self.balance_abs_threshold}, {self.max_tree_size} and {self.balance_rel_threshold}")
        for origin in self.origins():
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(f"allowed_origins: {origin!r} is not an origin such as https://example.com:8080")

    def origins(self) -> list[str]:
        """`allowed_origins` as a list (empty: no CORS)."""
        return [o.strip() for o in (self.allowed_origins or "").split(",") if o.strip()]


    def hosts(self) -> frozenset[str] | None:
        """The host names answered, lower case, without ports; None means any."""
        names = {h.strip().lower().strip("[]") for h in (self.allowed_hosts or "").split(",") if h.strip()}
        if "*" in names:
            return None
        if names:
            return frozenset(names)
        if self.host in LOOPBACK_HOSTS:
            return LOOPBACK_HOSTS
        return None


LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
_ORIGIN = re.compile(r"https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?|https?://\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")
