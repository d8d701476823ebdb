"""Start `kvlab serve`: load the model, start the engine, serve HTTP until SIGTERM or Ctrl-C.

On SIGTERM (or SIGINT) the server drains before uvicorn stops: it keeps accepting connections, so
`/health` answers 503 "shutting down" and new requests get a 503; requests in the system may finish
for `shutdown_timeout_s`, and those still running then end cleanly (a stream gets an error event and
`[DONE]`, a plain request a 503 error object). Pending prefix writes are finished, and only then is
uvicorn told to stop; the process exits 0. A second signal stops uvicorn at once.

Every step after the timeout is bounded, so the process exits within `shutdown_timeout_s` plus a
small margin: the engine thread ends its current tick (one prefill piece and one decoding step), prefix
writes get what is left of the timeout plus `kvlab.serve.engine.CLOSE_GRACE_S` (a slower store loses
them: they only save recomputation), and responses `FLUSH_TIMEOUT_S` to write their last bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn

from kvlab.compress import compressors
from kvlab.lossless.config import LosslessConfig
from kvlab.models import load_configured_model
from kvlab.serve.app import create_app
from kvlab.serve.config import ServeConfig
from kvlab.serve.engine import ServeEngine
from kvlab.serve.options import build_draft_weights, compile_forwards_now

logger = logging.getLogger(__name__)

# Seconds uvicorn waits for responses once the drain is over (they only have their last bytes to
# write) or once the engine failed; past it, it cancels them (a client that stops reading).
FLUSH_TIMEOUT_S = 2


@dataclasses.dataclass(frozen=True, slots=True)
class ServerStart:
    """What `run_server` is about to serve, once its model is loaded (the CLI prints it).

    Attributes:
        model_name: The model's name (the `model` requests name).
        url: Where it listens (the port as configured: 0 when the system picks one).
        config: Its settings.
    """

    model_name: str
    url: str
    config: ServeConfig


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


def run_server(
    config: ServeConfig, verbose: bool = False, on_start: Callable[[ServerStart], None] | None = None
) -> int:
    """Serve until stopped; returns the exit code (0 after a graceful shutdown).

    Args:
        config: The server's settings.
        verbose: Uvicorn logs every request.
        on_start: Told what is served once the model is loaded, before requests are taken.
    """
    lossless = default_lossless(config)
    loaded = load_configured_model(config)
    build_draft_weights(loaded, config)
    compile_forwards_now(loaded, config)
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
    start = ServerStart(loaded.name, f"http://{config.host}:{config.port}", config)
    logger.info("serving %s on %s (mode %s)", start.model_name, start.url, config.mode)
    if on_start is not None:
        on_start(start)
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
