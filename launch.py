"""Gyre entry point: parses flags, validates the config, and calls one library function.

    python launch.py   # the quick start: experiments/quickstart.py into workdirs/quickstart
    python launch.py --config=experiments/smoke.py --workdir=/tmp/gyre/smoke \
        --config.train.lr=3e-4

The experiment's ``run.entry`` names the library function (see gyre/run.py).
"""

import logging
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", "experiments/quickstart.py", "Experiment config file, optionally FILE.py:ARG."
)
_WORKDIR = flags.DEFINE_string(
    "workdir", "workdirs/quickstart", "Where the config, checkpoints, metrics and plots go."
)
_ALLOW_CHANGE = flags.DEFINE_bool(
    "allow_config_change",
    False,
    "Resume a workdir's run with a changed config (recorded in config_changes.jsonl).",
)


def parse_flags(argv):
    """absl parsing, with every bad flag or override reduced to one line naming it."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        if "Traceback (most recent call last):" in lines:  # an error inside the config file
            sys.exit(f"config error: {lines[0].split(': Error whilst')[0]}: {lines[-1]}")
        sys.exit(f"flag error: {e}")
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # an unknown dotted key
        while e.args and isinstance(e.args[0], BaseException):  # ml_collections wraps KeyError
            e = e.args[0]
        sys.exit(
            "config error: unknown or bad key " + " ".join(str(e.args[0] if e.args else e).split())
        )


def quiet_logs() -> None:
    """Library INFO logs (JAX backends, orbax options) off unless --verbosity is given."""
    if not flags.FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)
        logging.getLogger().setLevel(logging.WARNING)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    quiet_logs()
    from gyre import run  # after absl parsed flags, so XLA_FLAGS set by run apply first

    run.main(load_config(), _WORKDIR.value, allow_config_change=_ALLOW_CHANGE.value)


def load_config():
    """The --config value; a file that cannot be loaded is one line naming it."""
    try:
        cfg = _CONFIG.value
        cfg.keys()  # a file that failed to load is a placeholder that raises here
        return cfg
    except OSError as e:
        cause = e.__cause__ or e
        lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
        sys.exit(f"config error: cannot load --config={flags.FLAGS['config'].serialize()[9:]}"
                 f": {lines[-1] if lines else cause}")  # fmt: skip


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
