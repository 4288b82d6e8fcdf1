"""Gyre entry point: parses flags, validates the config, and calls one library function.

    python launch.py   # the quick start: experiments/quickstart.py into workdirs/quickstart
    python launch.py --config=experiments/smoke.py --workdir=/tmp/gyre/smoke \
        --config.train.lr=3e-4
    python launch.py --config=experiments/quickstart.py --workdir=workdirs/quickstart --mode=eval

The experiment's ``run.entry`` names the library function (see gyre/run.py).
"""

import logging
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags


def _one_line_config_error(e: BaseException) -> str:
    """A config file that cannot load, or an override it has no key for, as one line."""
    while e.args and isinstance(e.args[0], BaseException):  # ml_collections wraps KeyError
        e = e.args[0]
    if isinstance(e, OSError):  # the file: its last line says why (missing, syntax, ...)
        lines = [line.strip() for line in str(e.__cause__ or e).splitlines() if line.strip()]
        return f"config error: cannot load the --config file: {lines[-1] if lines else e}"
    return "config error: unknown or bad key " + " ".join(str(e.args[0] if e.args else e).split())


try:  # without --config the default file is read here, overrides included
    _CONFIG = config_flags.DEFINE_config_file(
        "config", "experiments/quickstart.py", "Experiment config file, optionally FILE.py:ARG."
    )
except (AttributeError, KeyError, OSError, TypeError, ValueError) as _e:
    sys.exit(_one_line_config_error(_e))
_WORKDIR = flags.DEFINE_string(
    "workdir", "workdirs/quickstart", "Where the config, checkpoints, metrics and plots go."
)
_MODE = flags.DEFINE_enum(
    "mode",
    "run",
    ["run", "eval"],
    "run: the experiment (or resume it); eval: evaluate the workdir's latest checkpoint (or, "
    "with none, --config.model.hf_dir) on the held-out tasks and print the end-of-run table.",
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
    except (AttributeError, KeyError, OSError, TypeError, ValueError) as e:  # a dotted key
        sys.exit(_one_line_config_error(e))  # (or the file missing: OSError)


def quiet_logs() -> None:
    """Library INFO logs (JAX backends, orbax options) off unless --verbosity is given."""
    if not flags.FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)
        logging.getLogger().setLevel(logging.WARNING)


def main(argv):
    if len(argv) > 1:
        sys.exit(f"flag error: unexpected arguments {argv[1:]} (flags are --name=value; "
                 "python launch.py --help lists them)")  # fmt: skip
    quiet_logs()
    from gyre import run  # after absl parsed flags, so XLA_FLAGS set by run apply first

    run.main(
        load_config(), _WORKDIR.value, allow_config_change=_ALLOW_CHANGE.value, mode=_MODE.value
    )


def check_booleans(cfg, argv) -> None:
    """absl reads 1, 0, yes, ... as booleans; a boolean key takes only true or false."""
    for arg in argv:
        if not arg.startswith("--config.") or "=" not in arg:
            continue
        path, value = arg[len("--config.") :].split("=", 1)
        node = cfg
        for part in path.split("."):
            node = node.get(part) if hasattr(node, "get") else None
        if isinstance(node, bool) and value.lower() not in ("true", "false"):
            sys.exit(f"config error: config key '{path}' must be true or false, got {value!r}")


def load_config():
    """The --config value; a file that cannot be loaded is one line naming it."""
    try:
        cfg = _CONFIG.value
        cfg.keys()  # a file that failed to load is a placeholder that raises here
        check_booleans(cfg, sys.argv[1:])
        return cfg
    except OSError as e:
        cause = e.__cause__ or e
        lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
        sys.exit(f"config error: cannot load --config={flags.FLAGS['config'].serialize()[9:]}"
                 f": {lines[-1] if lines else cause}")  # fmt: skip


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
