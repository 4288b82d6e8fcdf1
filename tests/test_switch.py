"""A role switch compiles nothing once warm: rollout->train->rollout of a cell through the real
Proxy, Engine and Trainer (first gradient on the newly trained cell, first decode on the newly
serving one), with XLA compilations counted by JAX's own compile event."""

import asyncio

import jax
import numpy as np
import pytest

import experiments.quickstart as quickstart
from benchmarks.switch import CompileCounter, microbatch
from gyre.rl.builder import build_runtime, build_specs
from gyre.rollout.types import GenerateRequest


def test_counter_counts_a_fresh_compilation():
    counter = CompileCounter()
    counter.active = True
    f = jax.jit(lambda x: x * 3.0 + 1.0)  # a new function: not in any cache
    f(np.ones(5, np.float32)).block_until_ready()
    assert (counter.compiles, counter.traces) == (1, 1)
    f(np.ones(5, np.float32)).block_until_ready()  # cached: nothing more
    assert counter.compiles == 1
    counter.active = False


def generate(proxy, request):
    async def go():
        pump = asyncio.create_task(proxy.run())
        try:
            return await proxy.generate(request)
        finally:
            pump.cancel()

    return asyncio.run(go())


@pytest.mark.slow
def test_role_switch_both_ways_compiles_nothing_after_warmup(tmp_path):
    cfg = quickstart.get_config("tiny")
    cfg.mesh.cell_size = 4  # two cells: the core (0) trains, cell 1 switches
    rt = build_runtime(build_specs(cfg), str(tmp_path))
    trainer, proxy, (core, cell) = rt.trainer, rt.proxy, rt.cells
    proxy.release(core.index)  # the core trains; cell 1 alone serves
    rows = cfg.train.rows_per_microbatch
    vocab = cfg.model.vocab_size

    def cycle(seed):
        """rollout->train (release, first gradient, update), train->rollout (admit, a call)."""
        proxy.release(cell.index)
        assert proxy.engines[cell.index].cache is None  # the cache is freed
        res = trainer.compute_grads(cell, microbatch(rows, 16, vocab, seed))
        jax.block_until_ready(res.grads)
        out = trainer.apply_step([res])
        proxy.set_weights(trainer.params, trainer.version)
        proxy.admit(cell.index, trainer.params, trainer.version)
        prompt = np.arange(1, 6, dtype=np.int32) % vocab
        resp = generate(proxy, GenerateRequest(f"e{seed}", 0, prompt, 3))
        assert len(resp.tokens) == 3 and set(resp.versions) == {trainer.version}
        return out.version

    counter = CompileCounter()
    assert cycle(0) == 1  # warm-up: programs compile here (unless an earlier test did)
    counter.active = True
    assert cycle(1) == 2 and cycle(2) == 3  # new weights each time: the moves really happen
    counter.active = False
    assert counter.compiles == 0, f"{counter.compiles} compilations on the switch path"
    assert counter.traces == 0
