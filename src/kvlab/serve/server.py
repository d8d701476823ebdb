"""Start `kvlab serve`: load the model, start the engine, serve HTTP until SIGTERM or Ctrl-C.

On SIGTERM (or SIGINT) uvicorn stops accepting connections and lets open requests finish for
`shutdown_timeout_s`; the app's shutdown then cancels what is left and finishes pending prefix
writes, and the process exits 0.
"""

from __future__ import annotations

import logging
import math
import signal
import sys

import uvicorn

from kvlab.compress import compressors
from kvlab.lossless.config import LosslessConfig
from kvlab.models import load_model
from kvlab.serve.app import create_app
from kvlab.serve.config import ServeConfig
from kvlab.serve.engine import ServeEngine

logger = logging.getLogger(__name__)


def default_lossless(config: ServeConfig) -> LosslessConfig:
    """Lossless settings requests start from (each may choose its own drafter and draft length)."""
    drafter = compressors.create_from_strings(config.drafter, list(config.drafter_args))
    return LosslessConfig(drafter, config.num_draft_tokens, draft_weights=config.draft_weights)  # type: ignore[arg-type]


def run_server(config: ServeConfig, verbose: bool = False) -> int:
    """Serve until stopped; returns the exit code (0 after a graceful shutdown)."""
    lossless = default_lossless(config)
    loaded = load_model(config.model, dtype=config.dtype, device=config.device)
    servers: list[uvicorn.Server] = []

    def stop_serving() -> None:  # the engine thread failed: exit non-zero rather than hang every request
        for server in servers:
            server.should_exit = True

    engine = ServeEngine(loaded, config, lossless, on_failure=stop_serving)
    app = create_app(engine, config, lossless)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="info" if verbose else "warning",
            # uvicorn reads 0 as "wait forever": a whole second is the shortest grace period.
            timeout_graceful_shutdown=max(1, math.ceil(config.shutdown_timeout_s)),
            lifespan="on",
        )
    )
    print(
        f"kvlab serve: {loaded.name} on http://{config.host}:{config.port} (mode {config.mode}; "
        f"{config.max_num_seqs} running, {config.max_queued_requests} queued at most)",
        file=sys.stderr,
        flush=True,
    )
    # Uvicorn re-raises the signal that stopped it once it has shut down, under the handler found at
    # start: an ignoring one makes a graceful SIGTERM end in exit status 0 (Ctrl-C still exits 130).
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    servers.append(server)
    try:
        server.run()
    finally:
        if not engine.closing:  # uvicorn failed before the app's shutdown ran (e.g. the port was taken)
            engine.shutdown(0.0)
    if engine.failure is not None:
        logger.error("kvlab serve: the engine failed (%s); exiting", engine.failure)
        return 1
    return 0 if server.started else 1
