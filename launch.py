"""Gyre entry point: parses flags, validates the config, and calls one library function.

    python launch.py   # the quick start: experiments/quickstart.py into workdirs/quickstart
    python launch.py --config=experiments/smoke.py --workdir=/tmp/gyre/smoke \
        --config.train.lr=3e-4

The experiment's ``run.entry`` names the library function (see gyre/run.py).
"""

import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", "experiments/quickstart.py", "Experiment config file, optionally FILE.py:ARG."
)
_WORKDIR = flags.DEFINE_string(
    "workdir", "workdirs/quickstart", "Where the config, checkpoints, metrics and plots go."
)


def parse_flags(argv):
    """absl parsing, with every bad flag or override reduced to one line naming it."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        sys.exit(f"flag error: {e}")
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # an unknown dotted key
        while e.args and isinstance(e.args[0], BaseException):  # ml_collections wraps KeyError
            e = e.args[0]
        sys.exit(
            "config error: unknown or bad key " + " ".join(str(e.args[0] if e.args else e).split())
        )


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from gyre import run  # after absl parsed flags, so XLA_FLAGS set by run apply first

    run.main(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
