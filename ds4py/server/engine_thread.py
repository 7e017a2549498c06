"""The engine thread and the bounded FIFO in front of it (worker.py holds what it runs on: the Engine, Jobs and
their outputs). The thread runs the Scheduler, which reads the queue through wait / peek / pop / closed; so
scheduler.py imports the worker's data and this module imports the scheduler, never the other way round."""

from __future__ import annotations

import collections
import logging
import threading

from .protocol import ApiError, Done
from .scheduler import Scheduler
from .worker import Engine, Job

log = logging.getLogger("ds4py.server")


class QueueFull(ApiError):
    pass


class Worker:
    """One engine thread and a bounded FIFO of waiting jobs (running jobs are not counted); the thread runs the
    Scheduler over the engine's sessions (one job at a time with one session, up to N with N)."""

    def __init__(self, engine: Engine, max_queue: int = 64):
        self.engine, self.max_queue = engine, max_queue
        self._pending: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._stopped = ""                       # why the engine thread ended on its own (a bug), if it did
        self._thread = threading.Thread(target=self._main, name="ds4py-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopped and not self._closed:
                raise ApiError(503, f"the engine stopped ({self._stopped}); restart the server",
                               kind="api_error", code="engine_stopped")
            if len(self._pending) >= self.max_queue:
                retry = max(1, len(self._pending) // 2)
                raise QueueFull(429, f"the server is busy: {len(self._pending)} requests are waiting "
                                     f"(--max-queue {self.max_queue}); retry later",
                                kind="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry)})
            self._pending.append(job)
            self.engine.metrics.queue_depth = len(self._pending)
            self._cv.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Cancel every job, let the engine thread finish its current model call and write the disk cache's
        shutdown checkpoints (waits up to `timeout` seconds for it)."""
        with self._cv:
            self._closed = True
            for job in self._pending:
                job.cancel.set()
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the engine did not stop within %.0f s; no shutdown checkpoints written", timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- the queue, as the engine thread sees it -----------------------------------------------------------
    def wait(self) -> bool:
        """Block until a job is waiting (True) or the worker is closed (False)."""
        with self._cv:
            while not self._pending and not self._closed:
                self._cv.wait()
            return not self._closed

    def peek(self) -> Job | None:
        with self._cv:
            return self._pending[0] if self._pending else None

    def pop(self) -> Job:
        with self._cv:
            job = self._pending.popleft()
            self.engine.metrics.queue_depth = len(self._pending)
            return job

    def _main(self) -> None:
        try:
            Scheduler(self.engine, self).run()
        except Exception as e:  # a bug: say so on every later request instead of letting them wait forever
            log.exception("the engine thread failed")
            self._stopped = f"{type(e).__name__}: {e}"
        finally:
            with self._cv:
                for job in self._pending:
                    self.engine.metrics.add(cancelled=1)
                    job.emit(Done("cancelled", len(job.ids)))
                self._pending.clear()
                self.engine.metrics.queue_depth = 0
            self.engine.close()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the engine thread to finish (after close()); True when it did within the timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()
