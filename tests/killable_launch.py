"""launch.py with a test hook: the run signals itself after N micro-batches (a kill, Ctrl-C or
a scheduler's preemption at an arbitrary point inside a step). Used by tests/test_controller.py;
takes launch.py's flags plus --kill_after_microbatches=N and --kill_signal=KILL|INT|TERM."""

import os
import signal
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import launch  # noqa: E402  (defines --config and --workdir)

_KILL_AFTER = flags.DEFINE_integer("kill_after_microbatches", 0, "signal after N micro-batches")
_SIGNAL = flags.DEFINE_enum("kill_signal", "KILL", ["KILL", "INT", "TERM"], "which signal")


def main(argv):
    del argv
    launch.quiet_logs()
    from gyre import run

    def hook(done: int) -> None:
        if done == _KILL_AFTER.value:
            os.kill(os.getpid(), getattr(signal, "SIG" + _SIGNAL.value))

    run.main(launch.load_config(), launch._WORKDIR.value, after_microbatch=hook)


if __name__ == "__main__":
    app.run(main, flags_parser=launch.parse_flags)
