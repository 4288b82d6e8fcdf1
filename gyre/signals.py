"""Stopping a run at a safe point: Ctrl-C (SIGINT) and SIGTERM, how schedulers preempt.

While the RL loop runs (:func:`armed`), the first signal asks it to stop after the step in
progress, which is then checkpointed; a second signal stops at once. Outside the loop (start-up,
warm start, evaluation before RL) a signal stops at once: the run resumes from what was saved.
"""

from __future__ import annotations

import contextlib
import signal
import threading

_armed = threading.Event()
_requested = threading.Event()


def _handler(signum, frame):
    if _armed.is_set() and not _requested.is_set():
        _requested.set()
        print(f"{signal.Signals(signum).name}: stopping after the step in progress "
              "(send it again to stop at once)", flush=True)  # fmt: skip
        return
    raise KeyboardInterrupt


def install() -> None:
    """Handles SIGINT and SIGTERM as above (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _handler)
        signal.signal(signal.SIGTERM, _handler)


def stop_requested() -> bool:
    return _requested.is_set()


@contextlib.contextmanager
def armed():
    """The block during which a first signal means 'stop after this step'."""
    _requested.clear()
    _armed.set()
    try:
        yield
    finally:
        _armed.clear()
