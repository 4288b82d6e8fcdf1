"""launch.py with test hooks for faults a run must survive or end cleanly on:

--kill_after_microbatches=N --kill_signal=KILL|INT|TERM   the run signals itself after N
    micro-batches (a kill, Ctrl-C or a scheduler's preemption at a point inside a step);
--nan_at_step=N         the first micro-batch gradient of optimizer step N (0-based) is NaN;
--hang_tools            every model call parses as a ledger tool call, which hangs forever (the
                        watchdog's case; the parse is forced so an untrained model hangs too).

Used by tests/test_controller.py and tests/test_faults.py; takes launch.py's flags too.
"""

import asyncio
import dataclasses
import os
import signal
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import launch  # noqa: E402  (defines --config and --workdir)

_KILL_AFTER = flags.DEFINE_integer("kill_after_microbatches", 0, "signal after N micro-batches")
_SIGNAL = flags.DEFINE_enum("kill_signal", "KILL", ["KILL", "INT", "TERM"], "which signal")
_NAN_AT = flags.DEFINE_integer("nan_at_step", -1, "make step N's first gradient NaN")
_HANG = flags.DEFINE_bool("hang_tools", False, "every model call is a tool call that hangs forever")


def _inject_nan(at: int) -> None:
    import jax
    import jax.numpy as jnp

    from gyre.train.step import Trainer

    real, done = Trainer.compute_grads, []

    def compute_grads(self, cell, mb):
        res = real(self, cell, mb)
        # RL only (not the warm start); only the oldest step trains: self.step is its number
        if self.spec.objective == "sft" or self.step != at or done:
            return res
        done.append(True)
        return dataclasses.replace(res, grads=jax.tree.map(lambda g: g * jnp.nan, res.grads))

    Trainer.compute_grads = compute_grads


def _hang_tools() -> None:
    from gyre.envs.base import ToolCall
    from gyre.envs.ledger import LedgerEnv

    def parse(self, completion, role):
        return ToolCall("commit", (1, 0))

    async def step(self, state, call, role):
        await asyncio.Event().wait()

    LedgerEnv.parse, LedgerEnv.step = parse, step


def main(argv):
    del argv
    launch.quiet_logs()
    from gyre import run

    if _NAN_AT.value >= 0:
        _inject_nan(_NAN_AT.value)
    if _HANG.value:
        _hang_tools()

    def hook(done: int) -> None:
        if done == _KILL_AFTER.value:
            os.kill(os.getpid(), getattr(signal, "SIG" + _SIGNAL.value))

    run.main(launch.load_config(), launch._WORKDIR.value, after_microbatch=hook)


if __name__ == "__main__":
    app.run(main, flags_parser=launch.parse_flags)
