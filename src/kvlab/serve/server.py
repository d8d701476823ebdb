"""Start `kvlab serve`: load the model, start the engine, serve HTTP until SIGTERM or Ctrl-C.

On SIGTERM (or SIGINT) the server drains before uvicorn stops: it keeps accepting connections, so
`/health` answers 503 "shutting down" and new requests get a 503; requests in the system may finish
for `shutdown_timeout_s`, and those still running then end cleanly (a stream gets an error event and
`[DONE]`, a plain request a 503 error object). Pending prefix writes are finished, and only then is
uvicorn told to stop; the process exits 0. A second signal stops uvicorn at once.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType

import uvicorn

from kvlab.compress import compressors
from kvlab.lossless.config import LosslessConfig
from kvlab.models import load_model
from kvlab.serve.app import create_app
from kvlab.serve.config import ServeConfig
from kvlab.serve.engine import ServeEngine

logger = logging.getLogger(__name__)

# Seconds uvicorn waits for responses once the drain is over (they only have their last bytes to
# write) or once the engine failed; past it, it cancels them.
FLUSH_TIMEOUT_S = 5


class Drain:
    """Shuts the engine down once, whoever asks first: a SIGTERM's drain (`DrainingServer`) or the
    app's end; a later caller waits for the first to finish."""

    def __init__(self, engine: ServeEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._done = False

    def __call__(self, timeout_s: float) -> None:
        """Refuse new requests (503), let those in the system finish for `timeout_s`, end the rest with an
        error event (`FailedEvent`), then finish pending prefix writes."""
        with self._lock:
            if not self._done:
                self._done = True
                self.engine.shutdown(timeout_s)


class DrainingServer(uvicorn.Server):
    """Uvicorn, draining on the first SIGTERM or SIGINT instead of stopping (see the module docstring).

    Uvicorn's own stop closes the listening socket first, so `/health` would refuse connections for
    the whole grace period and requests cut by it would lose their connection mid-reply. The drain
    instead runs in a thread while uvicorn serves on: the engine refuses new requests and fails the
    ones left at the timeout with an event the app turns into a clean end; then uvicorn stops, with
    nothing left to cut.
    """

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float) -> None:
        super().__init__(config)
        self.drain, self.timeout_s = drain, timeout_s
        self._draining: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining is not None or self.should_exit:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        logger.warning("kvlab serve: draining for up to %g s before stopping", self.timeout_s)

        def drain_then_stop() -> None:
            self.drain(self.timeout_s)
            super(DrainingServer, self).handle_exit(sig, frame)  # uvicorn records the signal and stops

        self._draining = threading.Thread(target=drain_then_stop, name="kvlab-serve-drain", daemon=True)
        self._draining.start()


def default_lossless(config: ServeConfig) -> LosslessConfig:
    """Lossless settings requests start from (each may choose its own drafter and draft length)."""
    drafter = compressors.create_from_strings(config.drafter, list(config.drafter_args))
    return LosslessConfig(drafter, config.num_draft_tokens, draft_weights=config.draft_weights)  # type: ignore[arg-type]


def run_server(config: ServeConfig, verbose: bool = False) -> int:
    """Serve until stopped; returns the exit code (0 after a graceful shutdown)."""
    lossless = default_lossless(config)
    loaded = load_model(
        config.model, dtype=config.dtype, device=config.device, packed_weights=not config.unpacked_weights
    )
    servers: list[uvicorn.Server] = []

    def stop_serving() -> None:  # the engine thread failed: exit non-zero rather than hang every request
        for server in servers:
            server.should_exit = True

    engine = ServeEngine(loaded, config, lossless, on_failure=stop_serving)
    drain = Drain(engine)
    app = create_app(engine, config, lossless, drain)
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="info" if verbose else "warning",
            timeout_graceful_shutdown=FLUSH_TIMEOUT_S,
            lifespan="on",
        ),
        drain,
        config.shutdown_timeout_s,
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
        drain(0.0)  # a no-op after the app's shutdown; needed when uvicorn failed first (the port was taken)
    if engine.failure is not None:
        logger.error("kvlab serve: the engine failed (%s); exiting", engine.failure)
        return 1
    return 0 if server.started else 1
