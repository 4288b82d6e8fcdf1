"""launch.py with a test hook: the run SIGKILLs itself after N micro-batches (a kill at an
arbitrary point inside a step). Used by tests/test_controller.py; takes launch.py's flags plus
--kill_after_microbatches=N."""

import os
import signal
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import launch  # noqa: E402  (defines --config and --workdir)

_KILL_AFTER = flags.DEFINE_integer("kill_after_microbatches", 0, "SIGKILL after N micro-batches")


def main(argv):
    del argv
    from gyre import run

    def hook(done: int) -> None:
        if done >= _KILL_AFTER.value:
            os.kill(os.getpid(), signal.SIGKILL)

    run.main(launch._CONFIG.value, launch._WORKDIR.value, after_microbatch=hook)


if __name__ == "__main__":
    app.run(main, flags_parser=launch.parse_flags)
