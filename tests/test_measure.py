"""The policy's figures come from the run's own timings: train tokens/s per cell and switch
seconds, each seeded until measured."""

import jax.numpy as jnp
import pytest

from gyre.rl.measure import RunFigures, RunningMean


def test_running_mean_starts_at_the_seed_and_follows_measurements():
    m = RunningMean(10.0, weight=0.5)
    assert m.value == 10.0 and m.count == 0
    m.update(2.0)  # the first measurement replaces the seed
    assert m.value == 2.0
    m.update(4.0)
    assert m.value == pytest.approx(3.0)
    with pytest.raises(ValueError, match="weight"):
        RunningMean(1.0, weight=0.0)


def test_unmeasured_cells_take_the_measured_mean_then_the_seed():
    f = RunFigures(3, seed_train_tps=500.0, seed_switch_s=2.0)
    assert f.train_throughput() == (500.0,) * 3
    f.record_microbatch(1, tokens=1000, seconds=4.0)
    assert f.train_throughput() == (250.0, 250.0, 250.0)  # the measured mean, not the seed
    f.record_microbatch(2, tokens=3000, seconds=1.0)
    assert f.train_throughput() == pytest.approx((1625.0, 250.0, 3000.0))
    assert (f.switch_r2t_s, f.switch_t2r_s) == (2.0, 2.0)
    f.record_switch("r2t", 0.5)
    assert (f.switch_r2t_s, f.switch_t2r_s) == (0.5, 2.0)
    with pytest.raises(ValueError, match="> 0"):
        RunFigures(1, 0.0, 1.0)


def test_a_micro_batch_is_timed_when_its_result_is_ready_not_at_dispatch():
    now = [100.0]
    f = RunFigures(2, seed_train_tps=1.0, seed_switch_s=0.0, clock=lambda: now[0])
    # The worker thread blocks on the array, then reads the clock: set the clock first.
    now[0] = 104.0
    f.time_microbatch(0, tokens=800, result=jnp.ones(3), dispatched=100.0)
    f.time_microbatch(0, tokens=400, result=jnp.ones(3), dispatched=101.0)
    f.close()
    f._worker.join(timeout=60)
    # the first took 4 s (dispatched at 100, ready at 104); the second started when the first
    # ended (104), not at its dispatch (101), and was ready at once
    assert f.train[0].count == 1 and f.train[0].value == pytest.approx(200.0)
    assert f.train[1].count == 0


def test_pool_counters_give_each_step_its_share():
    from gyre.rl.measure import PoolCounters

    pools = PoolCounters({"kv_evictions": 2, "kv_admissions": 4, "kv_admission_wait_s": 1.0,
                          "kv_resident_contexts": 3})  # fmt: skip
    row = pools.since_last({"kv_evictions": 5, "kv_admissions": 6, "kv_admission_wait_s": 2.0,
                            "kv_resident_contexts": 1})  # fmt: skip
    assert row["kv_evictions"] == 3 and row["kv_admissions"] == 2  # differences
    assert row["kv_resident_contexts"] == 1  # current state passes through
    assert row["kv_admission_wait_mean_s"] == pytest.approx(0.5)
