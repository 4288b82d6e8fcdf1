"""launch.py with test hooks for faults a run must survive or end cleanly on:

--kill_after_microbatches=N --kill_signal=KILL|INT|TERM   the run signals itself after N
    micro-batches (a kill, Ctrl-C or a scheduler's preemption at a point inside a step);
    --kill_after_new_microbatches=N counts only this launch's (a resumed run's count starts
    at its checkpoint's);
--nan_at_step=N         the first micro-batch gradient of optimizer step N (0-based) is NaN;
--hang_tools            every model call parses as a ledger tool call, which hangs forever (the
                        watchdog's case; the parse is forced so an untrained model hangs too);
--kill_at=restore|rewrite|save --kill_at_count=N   SIGKILL at the N-th (1-based) checkpoint
    restore (a resume, before the run files are cut back), atomic rewrite of metrics.jsonl,
    ledger.jsonl or trace.jsonl (the temporary file written, os.replace not yet done), or
    checkpoint save (the asynchronous write just started). scripts/kill_run.py uses these.

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
_KILL_AFTER_NEW = flags.DEFINE_integer("kill_after_new_microbatches", 0,
                                       "signal after N micro-batches of this launch")  # fmt: skip
_SIGNAL = flags.DEFINE_enum("kill_signal", "KILL", ["KILL", "INT", "TERM"], "which signal")
_NAN_AT = flags.DEFINE_integer("nan_at_step", -1, "make step N's first gradient NaN")
_HANG = flags.DEFINE_bool("hang_tools", False, "every model call is a tool call that hangs forever")
_KILL_AT = flags.DEFINE_enum("kill_at", "", ["", "restore", "rewrite", "save"],
                             "SIGKILL at the --kill_at_count-th such event")  # fmt: skip
_KILL_AT_COUNT = flags.DEFINE_integer("kill_at_count", 1, "which occurrence (1-based)")
RUN_FILES = ("metrics.jsonl", "ledger.jsonl", "trace.jsonl")


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


def _kill_at(where: str, count: int) -> None:
    """SIGKILL this process at the ``count``-th ``where`` event (see the module docstring)."""
    seen = []

    def hit() -> None:
        seen.append(1)
        if len(seen) == count:
            os.kill(os.getpid(), signal.SIGKILL)

    from gyre.train.checkpoint import Checkpointer

    if where == "restore":
        restore = Checkpointer.restore

        def restore_and_kill(self, *args, **kwargs):
            out = restore(self, *args, **kwargs)
            hit()
            return out

        Checkpointer.restore = restore_and_kill
    elif where == "save":
        save = Checkpointer.save

        def save_and_kill(self, *args, **kwargs):
            save(self, *args, **kwargs)  # asynchronous: the write is under way
            hit()

        Checkpointer.save = save_and_kill
    elif where == "rewrite":
        replace = os.replace

        def replace_or_kill(src, dst, **kwargs):
            if os.path.basename(str(dst)) in RUN_FILES:
                hit()  # the whole new file is written beside the old one, not yet in place
            return replace(src, dst, **kwargs)

        os.replace = replace_or_kill


def main(argv):
    del argv
    launch.quiet_logs()
    from gyre import run

    if _NAN_AT.value >= 0:
        _inject_nan(_NAN_AT.value)
    if _HANG.value:
        _hang_tools()
    if _KILL_AT.value:
        _kill_at(_KILL_AT.value, _KILL_AT_COUNT.value)

    first = []

    def hook(done: int) -> None:
        if not first:
            first.append(done)
        new = done - first[0] + 1  # micro-batches done by this launch
        if done == _KILL_AFTER.value or new == _KILL_AFTER_NEW.value:
            os.kill(os.getpid(), getattr(signal, "SIG" + _SIGNAL.value))

    run.main(launch.load_config(), launch._WORKDIR.value, after_microbatch=hook)


if __name__ == "__main__":
    app.run(main, flags_parser=launch.parse_flags)
