"""Background asyncio tasks whose first error ends the run at once (never a silent hang)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine


class Supervised:
    """Starts tasks, keeps the first error one of them raised, and wakes the owner's loop
    (``wake()``) so that it can raise it (:meth:`check`)."""

    def __init__(self, wake: Callable[[], None]):
        self.wake = wake
        self.failure: BaseException | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self, coro: Coroutine) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()
            self.wake()

    def check(self) -> None:
        """Raises the first error of any task started here."""
        if self.failure is not None:
            raise self.failure

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()
