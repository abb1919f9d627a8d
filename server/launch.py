"""`hicache serve`: start the scheduler process (one a replica under `--dp-size`), then uvicorn;
stop them all on SIGTERM / Ctrl-C.

Shutdown order (SIGTERM, Ctrl-C): uvicorn stops accepting and gives in-flight requests
`graceful_shutdown_timeout` seconds; then every request still open is ended with a 503 (a stream:
its family's error event and terminator, `[DONE]` for OpenAI's) and aborted (`DrainingServer`),
and what has not finished `END_STREAMS_S` later is cancelled; then the scheduler process is asked
to exit, and terminated / killed if it does not. The server exits 0. A SIGTERM while the
model is still loading cancels the startup and stops the child as well. Either way the scheduler
sockets' directory is removed.

If the scheduler process dies while serving, its in-flight requests fail (503), then the server
shuts down the same way and exits with EXIT_SCHEDULER_DIED, for its supervisor to restart it;
with `--restart-scheduler` the tokenizer manager starts a new scheduler process instead.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

import torch
import uvicorn

from hicache.server.app import MAX_HEADER_BYTES, create_app
from hicache.server.config import ServerConfig
from hicache.server.http_protocol import guarded_protocol
from hicache.server.routing import Router
from hicache.server.scheduler_process import DEFAULT_FACTORY
from hicache.server.tokenizer_manager import TokenizerManager

logger = logging.getLogger("hicache.server")
KEEP_ALIVE_S = 5
EXIT_SCHEDULER_DIED = 3
END_STREAMS_S = 5.0  # after the grace period, the time ended streams get to send their last events
SHUTTING_DOWN = "the server is shutting down"


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown ends the requests still open after `grace` seconds with an
    error of their family rather than cutting their connections."""

    def __init__(self, config: uvicorn.Config, tm: TokenizerManager, grace: float) -> None:
        super().__init__(config)
        self.tm, self.grace = tm, grace

    async def shutdown(self, sockets=None) -> None:
        ender = asyncio.create_task(self._end_streams())
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()

    async def _end_streams(self) -> None:
        await asyncio.sleep(self.grace)
        n = self.tm.end_streams(SHUTTING_DOWN)
        if n:
            logger.info("shutting down: %d open requests ended with an error", n)


def run(server_config: ServerConfig, runtime_config, cache_config, factory: str = DEFAULT_FACTORY) -> int:
    """Serve until stopped; returns the process exit code."""
    torch.set_num_threads(1)  # the scheduler process computes; the cores are its pool's (scheduler_process)
    logging.basicConfig(level=server_config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        sock = listen(server_config.host, server_config.port)
    except OSError as e:
        where = f"{server_config.host}:{server_config.port}"
        print(f"hicache: cannot listen on {where}: {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(_serve(server_config, runtime_config, cache_config, factory, sock))
    except KeyboardInterrupt:
        return 130
    finally:
        sock.close()


def listen(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the model loads, so that a busy port or an
    address this machine does not have is an error at once (and the port stays ours meanwhile)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


async def _serve(server_config: ServerConfig, runtime_config, cache_config, factory: str, sock: socket.socket) -> int:
    tm = TokenizerManager(runtime_config, cache_config, factory=factory, warm_up=not server_config.skip_server_warmup,
                          restart_scheduler=server_config.restart_scheduler,
                          router=make_router(server_config, cache_config.page_size))
    _cancel_on_signals(asyncio.current_task())
    try:
        print(f"hicache: loading {runtime_config.model_path or 'the default model (SmolLM2-135M-Instruct)'} ...",
              file=sys.stderr, flush=True)
        await tm.start(server_config.startup_timeout)
        _ignore_signals()  # from here uvicorn owns SIGINT / SIGTERM (and re-raises them after its shutdown)
        grace = server_config.graceful_shutdown_timeout
        server = DrainingServer(uvicorn.Config(
            create_app(tm, server_config), host=server_config.host, port=server_config.port,
            log_level=server_config.log_level, timeout_graceful_shutdown=grace + END_STREAMS_S,
            access_log=server_config.log_level == "debug", **http_options(server_config)), tm, grace)
        tm.on_fatal = lambda _reason: setattr(server, "should_exit", True)
        server.should_exit = tm.fatal_reason is not None
        announce = asyncio.create_task(_announce(server, server_config, tm))
        await server.serve(sockets=[sock])
        announce.cancel()
        if tm.fatal_reason is not None:
            print(f"hicache: {tm.fatal_reason}; exiting with code {EXIT_SCHEDULER_DIED} for the supervisor to "
                  "restart the server (or serve with --restart-scheduler)", file=sys.stderr, flush=True)
            return EXIT_SCHEDULER_DIED
        return 0 if server.started else 1
    except asyncio.CancelledError:
        print("hicache: interrupted during startup", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"hicache: {e}", file=sys.stderr)
        return 1
    finally:
        await asyncio.shield(tm.shutdown())


def make_router(config: ServerConfig, page_size: int) -> Router:
    """The replicas' router, as the `--dp-size` and routing flags say."""
    return Router(config.dp_size, config.load_balance_method, page_size, config.cache_threshold,
                  config.balance_abs_threshold, config.balance_rel_threshold, config.max_tree_size)


def http_options(config: ServerConfig) -> dict:
    """uvicorn's HTTP options: h11 with read deadlines, a connection cap and JSON errors
    (`http_protocol`); h11 buffers at most MAX_HEADER_BYTES of an incomplete request line and
    headers (431, or 414 for the line alone); idle kept-alive connections close after KEEP_ALIVE_S."""
    return {"http": guarded_protocol(config.request_read_timeout), "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
            "timeout_keep_alive": KEEP_ALIVE_S}


async def _announce(server: uvicorn.Server, config: ServerConfig, tm: TokenizerManager) -> None:
    while not server.started:
        await asyncio.sleep(0.05)
    host = "127.0.0.1" if config.host in ("0.0.0.0", "") else config.host
    url = f"http://{host}:{config.port}"
    replicas = f" on {tm.dp_size} replicas ({tm.router.method})" if tm.dp_size > 1 else ""
    print(f"hicache: serving {(config.served_model_name or (tm.info.model_name,))[0]}{replicas} at {url} "
          f"(OpenAI base URL {url}/v1; stats: hicache stats --url {url})", flush=True)


def _cancel_on_signals(task: asyncio.Task) -> None:
    loop = asyncio.get_running_loop()

    def handler(signum, _frame):
        loop.call_soon_threadsafe(task.cancel)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def _ignore_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
