"""A watchdog that ends a run in which nothing has progressed for too long.

The controller calls :meth:`Watchdog.beat` whenever something finishes (a model call, an
execution, a micro-batch, a step). A daemon thread checks the time since the last beat; past
``timeout_s`` it calls ``on_expire(message)``. The default action suits a hang anywhere, a
C call that never returns included, where no Python exception can be raised: it writes every
thread's stack to ``error_path``, prints one line and ends the process with exit code 3.
Checkpoints are taken at step boundaries, so a relaunch resumes exactly as after a kill.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

EXIT_CODE = 3


class Watchdog:
    """timeout_s: seconds without a beat before ``on_expire`` (0: never; the watchdog is
    off); describe() -> str says where the run stands (in the message); clock: seconds,
    monotonic (tests pass their own). Use as a context manager around the watched work."""

    def __init__(self, timeout_s: float, describe=lambda: "", on_expire=None,
                 error_path: str | None = None, clock=time.monotonic):  # fmt: skip
        if timeout_s < 0:
            raise ValueError(f"watchdog timeout must be >= 0, got {timeout_s}")
        self.timeout_s, self.describe, self.clock = float(timeout_s), describe, clock
        self.error_path = error_path
        self.on_expire = on_expire or self._abort
        self.last = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self.last = self.clock()

    def check(self) -> str | None:
        """The expiry message if no beat came for ``timeout_s``, else None."""
        idle = self.clock() - self.last
        if not self.timeout_s or idle < self.timeout_s:
            return None
        try:  # the watchdog must fire even when the run's state cannot be described
            where = self.describe()
        except Exception as e:
            where = f"state unavailable: {type(e).__name__}: {e}"
        return (f"watchdog: no progress for {idle:.0f} s (run.watchdog_s={self.timeout_s:g})"
                + (f"; {where}" if where else ""))  # fmt: skip

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> Watchdog:
        self.beat()
        if not self.timeout_s:
            return self
        self._thread = threading.Thread(target=self._loop, name="gyre-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        period = min(self.timeout_s / 4, 5.0)
        while not self._stop.wait(period):
            message = self.check()
            if message is not None:
                self.on_expire(message)
                return

    def _abort(self, message: str) -> None:
        where = ""
        if self.error_path:
            with open(self.error_path, "w") as f:
                f.write(message + "\n\nStacks of every thread at expiry:\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            where = f" (thread stacks in {self.error_path})"
        sys.stderr.write(f"error: {message}{where}; relaunch the same command to resume from "
                         "the last checkpoint\n")  # fmt: skip
        sys.stderr.flush()
        os._exit(EXIT_CODE)
