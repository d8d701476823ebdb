"""A background writer: runs jobs in order on one thread, and hands what went wrong back to the caller.

Saving prefix chunks is best effort, so store faults (`StoreUnavailableError`) are logged once and
counted, and generation goes on. Any other exception is a defect or a resource failure the caller
must see: the first one is raised from the next `flush()` or `close()` in the calling thread. The
thread survives every exception, so `flush()` never waits on jobs that a dead thread left queued.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from kvlab.store.backends.base import StoreUnavailableError

logger = logging.getLogger(__name__)


class BackgroundWriteError(RuntimeError):
    """A background write failed for a reason other than the store being unavailable."""


class ChunkWriter:
    """Jobs run in submission order on a daemon thread, started on the first `submit`.

    Attributes:
        num_failed: Jobs that failed with a store fault.
    """

    def __init__(self, name: str = "kvlab-prefix-write") -> None:
        self.name = name
        self.num_failed = 0
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
        self._jobs.put(job)

    def flush(self) -> None:
        """Wait until every submitted job ran; raise the first non-store exception a job raised."""
        self._jobs.join()
        self._raise_carried()

    def close(self) -> None:
        """Run what is queued, stop the thread, then raise like `flush`."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._jobs.put(None)
            thread.join()
        self._raise_carried()

    def _raise_carried(self) -> None:
        error, self._error = self._error, None
        if error is None:
            return
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise error
        raise BackgroundWriteError(f"saving prefix chunks failed: {type(error).__name__}: {error}") from error

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except StoreUnavailableError as error:
                self.num_failed += 1
                if self.num_failed == 1:
                    logger.warning("saving prefix chunks failed (%s); generation is unaffected", error)
            except BaseException as error:
                if self._error is None:
                    self._error = error
            finally:
                self._jobs.task_done()
        self._jobs.task_done()
