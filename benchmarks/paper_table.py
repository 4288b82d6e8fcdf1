"""The QwenGyre end-to-end table, with the cluster simulator, compared like for like.

    python benchmarks/paper_table.py [--steps N] [--seeds S] [--scenario SUBSTRING]
                                     [--handover migrate|reprefill] [--admission resident|fifo]
                                     [--no-memory] [--load L]

For each scenario (experiments/paper_table.py) and each workload seed it runs colocate, async
at every fixed split, and elastic at the configured staleness bound and at staleness 0, on a
cost model with per-cell memory (KV pool from the model and the hardware, see
``memory_cost``). It prints, per policy: end-to-end hours, equal-work hours (the hours to
train the workload's full token count at the policy's trained tokens per hour: timeouts cut
executions short, so hours alone compare different amounts of work), tokens per hour and
per execution, timeouts, completed executions per hour, utilisation, evictions and
re-prefill (a row whose policies differ by more than 10 points in timeout share says so);
then elastic's ratios, mean
+- standard error over the seeds: vs colocate, vs colocate at equal staleness (elastic at
staleness 0), vs async at half split and at its best split (the split with the least mean
equal-work hours, swept per scenario). Every assumption is printed with the table. The last
line is one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gyre.elastic import calibration  # noqa: E402
from gyre.elastic.costs import CellMemory, hardware_engine_fields, kv_bytes_per_token  # noqa: E402
from gyre.elastic.policy import CLOSE_ON, PolicyParams  # noqa: E402
from gyre.elastic.sim import simulate  # noqa: E402
from gyre.elastic.workload import generate  # noqa: E402

# Hardware and engine figures the calibration files do not carry (printed with the table).
HBM_BYTES = 141e9  # H200 SXM datasheet: memory per device
RESERVE = 0.10  # of device memory kept for activations and workspaces (vLLM's default 0.9 use)
LINK_PER_DEVICE = 50e9  # bytes/s: one 400 Gb/s InfiniBand NDR port per device
MIXED_CHUNK = 8192  # tokens of prefill per engine step, alongside decode
# KV shape per calibration, as its 'source' states it: (layers, kv heads, head dim, dtype
# bytes, tensors: 2 = K and V, 1 = a compressed latent).
KV_SHAPE = {"h200_122b_a10b": (48, 4, 128, 2, 2), "h200_2p4t": (96, 1, 576, 1, 1)}

MEMORY_ASSUMPTIONS = (
    f"Cell memory = devices x {HBM_BYTES / 1e9:.0f} GB (H200); KV pool = that x "
    f"{1 - RESERVE:.2f} - weights (parameters x bytes per parameter); KV bytes per token = "
    "layers x kv heads x head dim x tensors x dtype bytes (shapes as the calibration's source "
    "states them).",
    "Decode batch = the cell's live requests (no slot cap); a request reserves its call's "
    "final context; a call returns to the cell holding its context when it has room, else "
    "prefills its whole prompt elsewhere. {admission}",
    "Rollout capacity the elastic policy sees: KV pool / mean peak context of the executions "
    "finished so far (what the controller can measure).",
    f"Prefill runs alongside decode in chunks of {MIXED_CHUNK} tokens; prefill and training "
    "attention cost 4 x layers x attn_dim FLOPs per (token, context token) at the "
    "calibration's MFU (training x3), replacing its fixed mean-context training term.",
    f"Hand-over: {{handover}}; KV migration at {LINK_PER_DEVICE / 1e9:.0f} GB/s per device "
    "(400 Gb/s NDR); gradient all-reduce over the train cells on the same links (bf16 "
    "gradients, ring: 2 (n-1)/n x bytes / link).",
    "Rollout cells pause to load each new version for the train->rollout switch time "
    "(3.5 s, the paper's measured figure); KV stays valid.",
    "Timeouts run from an execution's first admission to a cell, not its dispatch.",
    "Equal-work hours = hours x (workload's full tokens / tokens trained); tokens/h ratios "
    "equal equal-work hour ratios. Seeds vary the workload; +- is one standard error over "
    "seeds. The best async split is picked on the same seeds (in async's favour).",
)


ADMISSION = {
    "resident": "Resident admission: an execution is admitted to a cell only while its context "
    "can stay resident there (a reservation of its context, at least the mean peak of the "
    "executions finished so far, growing with it); calls of admitted executions go first; "
    "nothing is evicted; a hand-over moves reservations with the contexts.",
    "fifo": "FIFO admission per request (--admission fifo): idle contexts stay resident until "
    "evicted (LRU); nothing holds an execution back so that its context stays resident.",
}
# A row whose policies differ by more than this in timeout share compares different work.
TIMEOUT_SPREAD = 0.10


def load_scenarios(steps):
    spec = importlib.util.spec_from_file_location(
        "paper_table_cfg", os.path.join(ROOT, "experiments", "paper_table.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while it loads
    spec.loader.exec_module(mod)
    return mod.scenarios(steps)


def memory_cost(name: str, replication: int, handover: str = "migrate",
                admission: str = "resident"):  # fmt: skip
    """(replicated cost model with the memory model, CellMemory, per-real-cell figures)."""
    with open(os.path.join(calibration.CALIBRATIONS_DIR, name + ".json")) as f:
        spec = json.load(f)
    base = calibration.from_dict(spec)
    hw, model = spec["hardware"], spec["model"]
    kv = kv_bytes_per_token(*KV_SHAPE[name])
    if kv != model["kv_bytes_per_token"]:
        raise ValueError(f"{name}: KV shape gives {kv} B/token, the calibration says "
                         f"{model['kv_bytes_per_token']}")  # fmt: skip
    devices = hw["devices_per_cell"]
    mem = CellMemory(HBM_BYTES, devices, model["total_params"] * model["bytes_per_param"], kv,
                     RESERVE)  # fmt: skip
    fields = hardware_engine_fields(spec, mem, LINK_PER_DEVICE * devices)
    cost = dataclasses.replace(base, **fields, slots=0, cell_capacity=0.0, mixed_chunk=MIXED_CHUNK,
                               handover_migrate=handover == "migrate",
                               resident_admission=admission == "resident",
                               weight_load_s=base.switch_t2r_s)  # fmt: skip
    return cost.replicated(replication), mem, cost


def plain_cost(sc):
    """The previous model: no memory, 64 slots, a cell 'full' at executions per step / cells."""
    cost = calibration.load(sc.calibration)
    cap = sc.real_executions_per_step / sc.num_cells
    return dataclasses.replace(cost, cell_capacity=cap).replicated(sc.replication)


def steady_hours(r, full_tokens: float, step_of: dict) -> float:
    """Equal-work hours at the steady rate: tokens trained over time between step ends, in
    windows of an even number of step intervals inside the ends of steps 1..N-2 (no
    pipeline fill, no drain): the window from step 1's end to step N-2's if that spans an
    even number of intervals, else the two windows from 1 to N-3 and from 2 to N-2, pooled
    (their tokens over their times). The whole run's figure if N < 5.

    Even, because a policy whose steps end in pairs (two steps rolled out together, then
    trained: elastic at staleness 1) has a cycle of two steps; a window of an odd number of
    intervals cuts that cycle at different phases at its two ends and is biased by up to
    one step's tokens (12.5% low or 17% high over 7 intervals of evenly paired ends), while
    an even window spans whole cycles at either phase. For steps that end evenly every
    window gives the same rate (window_hours is the previous, odd, one)."""
    n, ends = len(r.step_end_s), r.step_end_s
    if n < 5:
        return r.makespan_s / 3600 * full_tokens / r.counters["trained_tokens"]
    per_step = np.zeros(n)
    for eid, o in r.outcomes.items():
        per_step[step_of[eid]] += o[3]
    spans = [(1, n - 2)] if (n - 3) % 2 == 0 else [(1, n - 3), (2, n - 2)]
    tokens = sum(per_step[a + 1 : b + 1].sum() for a, b in spans)
    seconds = sum(ends[b] - ends[a] for a, b in spans)
    return full_tokens * seconds / tokens / 3600


def window_hours(r, full_tokens: float, step_of: dict) -> float:
    """The previous steady figure, for comparison: the tokens of steps 2..N-2 over the time
    between the ends of steps 1 and N-2 (an odd number of intervals when N is even: biased
    by step phase, see steady_hours)."""
    n, ends = len(r.step_end_s), r.step_end_s
    if n < 4:
        return r.makespan_s / 3600 * full_tokens / r.counters["trained_tokens"]
    tokens = sum(o[3] for eid, o in r.outcomes.items() if 2 <= step_of[eid] <= n - 2)
    return full_tokens * (ends[n - 2] - ends[1]) / tokens / 3600


def run_stats(r, full_tokens: float, replication: int, step_of: dict) -> dict:
    tokens = r.counters["trained_tokens"]
    n = len(r.outcomes)
    timeouts = sum(o[0] == "timeout" for o in r.outcomes.values())
    hours = r.makespan_s / 3600
    return {
        "hours": hours,
        "equal_work_h": hours * full_tokens / tokens,
        "steady_equal_work_h": steady_hours(r, full_tokens, step_of),
        "window_equal_work_h": window_hours(r, full_tokens, step_of),
        "tokens_per_h_m": tokens * replication / hours / 1e6,
        "tokens_per_exec_k": tokens / n / 1e3,
        "timeout_share": timeouts / n,
        # executions that ran to their end (not cut by the timeout), real ones per hour
        "completed_per_h": (n - timeouts) * replication / hours,
        "utilisation": r.utilisation,
        "lower_bound_h": r.lower_bound_s / 3600,
        "switches": r.switches,
        "evictions_per_exec": r.counters["evictions"] / n,
        "reprefill_per_trained": r.counters["reprefill_tokens"] / tokens,
        "migrated_contexts": r.counters["migrated_contexts"] * replication,
        "mean_decode_batch": r.counters["mean_decode_batch"] * replication,
        # step length (between step ends; the first from the start), and groups carried over
        "mean_step_h": float(np.mean(np.diff([0.0, *r.step_end_s]))) / 3600,
        "max_step_h": float(np.max(np.diff([0.0, *r.step_end_s]))) / 3600,
        "carried_per_step": r.counters.get("carried", 0.0) / max(1, len(r.step_end_s)),
    }


def mean_se(xs) -> dict:
    xs = np.asarray(xs, float)
    se = float(xs.std(ddof=1) / np.sqrt(len(xs))) if len(xs) > 1 else 0.0
    return {"mean": float(xs.mean()), "se": se}


def average(runs: list[dict]) -> dict:
    out = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
    for k in ("hours", "equal_work_h", "steady_equal_work_h", "tokens_per_h_m", "timeout_share"):
        out[k + "_se"] = mean_se([r[k] for r in runs])["se"]
    return out


def run_scenario(sc, seeds: int, cost, splits=None) -> dict:
    """Every policy on ``seeds`` workloads; async at every split (or those in ``splits``)."""
    k, p = sc.num_cells, sc.params
    splits = list(splits or range(1, k))
    half = p.async_rollout_cells or k // 2
    if half not in splits:
        splits.append(half)
    runs = {name: [] for name in ("colocate", "elastic", "elastic_s0")}
    runs.update({f"async_{r}": [] for r in splits})
    peaks = []
    for i in range(seeds):
        w = dataclasses.replace(sc.workload, seed=sc.workload.seed + 1000 * i)
        steps = generate(w)
        peaks += [max(c.prompt_tokens + c.completion_tokens for c in ex.calls)
                  for batch in steps for ex in batch]  # fmt: skip
        full = sum(ex.train_tokens for batch in steps for ex in batch)
        step_of = {ex.execution_id: ex.step for batch in steps for ex in batch}
        todo = [("colocate", "colocate", p), ("elastic", "elastic", p),
                ("elastic_s0", "elastic", dataclasses.replace(p, max_staleness=0))]  # fmt: skip
        todo += [(f"async_{r}", "async", dataclasses.replace(p, async_rollout_cells=r))
                 for r in splits]  # fmt: skip
        for key, policy, params in todo:
            r = simulate(steps, k, policy, cost, params)
            runs[key].append(run_stats(r, full, sc.replication, step_of))
    split_h = {r: float(np.mean([x["equal_work_h"] for x in runs[f"async_{r}"]])) for r in splits}
    best = min(split_h, key=lambda r: (split_h[r], r))
    policies = {
        "colocate": average(runs["colocate"]),
        "async_half": {**average(runs[f"async_{half}"]), "split": half},
        "async_best": {**average(runs[f"async_{best}"]), "split": best},
        "elastic": average(runs["elastic"]),
        "elastic_s0": average(runs["elastic_s0"]),
    }
    e, e0 = runs["elastic"], runs["elastic_s0"]

    def ratio(other, mine=e, key="equal_work_h"):
        return mean_se([o[key] / m[key] for o, m in zip(other, mine)])

    return {
        "name": sc.name,
        "seeds": seeds,
        "steps": sc.workload.steps,
        "cells": k,
        "executions_per_step": sc.real_executions_per_step,
        "policies": policies,
        "async_splits": {str(r): h for r, h in sorted(split_h.items())},
        "best_async_split": best,
        "lower_bound_h": min(v["lower_bound_h"] for v in policies.values()),
        # other / elastic in equal-work hours = elastic / other in tokens per hour
        "vs_colocate": ratio(runs["colocate"]),
        "vs_colocate_equal_staleness": ratio(runs["colocate"], e0),
        "vs_async_half": ratio(runs[f"async_{half}"]),
        "vs_async_best": ratio(runs[f"async_{best}"]),
        # The same at the steady rate (steady_hours: even windows inside the ends of steps
        # 1..N-2; short runs' fill and drain favour elastic over a fixed split, whose train
        # cells idle while the first step rolls out).
        "steady": {
            "vs_colocate": ratio(runs["colocate"], key="steady_equal_work_h"),
            "vs_colocate_equal_staleness": ratio(runs["colocate"], e0, "steady_equal_work_h"),
            "vs_async_half": ratio(runs[f"async_{half}"], key="steady_equal_work_h"),
            "vs_async_best": ratio(runs[f"async_{best}"], key="steady_equal_work_h"),
        },
        "hours_vs_colocate": ratio(runs["colocate"], key="hours"),
        "hours_vs_async_half": ratio(runs[f"async_{half}"], key="hours"),
        "reported": sc.reported,
        "mean_peak_context": float(np.mean(peaks)),
        **timeout_flag(policies),
    }


def timeout_flag(policies: dict) -> dict:
    """Spread of the timeout shares across the policies, and whether it exceeds 10 points
    (then equal-work hours compare executions cut at different lengths)."""
    shares = [v["timeout_share"] for v in policies.values()]
    spread = max(shares) - min(shares)
    return {"timeout_spread": spread, "timeouts_differ": spread > TIMEOUT_SPREAD}


def fmt_range(r) -> str:
    lo, hi = r
    return f"{lo:.2f}x" if lo == hi else f"{lo:.2f}-{hi:.2f}x"


def pm(d: dict, digits: int = 2) -> str:
    return f"{d['mean']:.{digits}f}x +- {d['se']:.{digits}f}"


def print_scenario(sc, res: dict, mem, real_cost, staleness: int) -> None:
    p = res["policies"]
    print(f"\n== {sc.name}: {res['steps']} steps x {res['executions_per_step']} executions, "
          f"{res['cells']} cells ({sc.calibration}), {res['seeds']} seeds")  # fmt: skip
    if mem is not None:
        print(f"   cell memory {mem.total_bytes / 1e9:.0f} GB = weights {mem.weight_bytes / 1e9:.0f} GB"
              f" + reserve {mem.reserve_fraction * mem.total_bytes / 1e9:.0f} GB + KV pool "
              f"{mem.kv_pool_bytes / 1e9:.0f} GB = {mem.kv_tokens / 1e6:.2f}M tokens at "
              f"{mem.kv_bytes_per_token:,.0f} B/token")  # fmt: skip
        m = res["memory"]
        print(f"   KV pool holds {m['contexts_per_cell']:.0f} contexts of the mean peak size "
              f"({m['mean_peak_context_k']:.0f}K tokens) per cell, against "
              f"{res['executions_per_step'] / res['cells']:.0f} executions per cell per step")  # fmt: skip
    head = (f"   {'policy':18s} {'hours':>7s} {'equal-work h':>15s} {'steady':>7s} {'M tok/h':>8s} "
            f"{'K tok/exec':>10s} {'timeouts':>8s} {'done/h':>7s} {'util':>5s} {'evict/exec':>10s} "
            f"{'re-prefill':>10s} {'batch':>6s} {'switches':>8s}")  # fmt: skip
    print(head)
    labels = {
        "colocate": "colocate (s=0)",
        "async_half": f"async half R={p['async_half']['split']}",
        "async_best": f"async best R={p['async_best']['split']}",
        "elastic": f"elastic (s={staleness})",
        "elastic_s0": "elastic (s=0)",
    }
    for key, label in labels.items():
        v = p[key]
        rep = sc.reported.get("hours", {}).get(key)
        extra = f"  (reported {rep:.1f} h)" if rep else ""
        print(f"   {label:18s} {v['hours']:7.1f} {v['equal_work_h']:8.1f} +-{v['equal_work_h_se']:5.1f} "
              f"{v['steady_equal_work_h']:7.1f} "
              f"{v['tokens_per_h_m']:8.1f} {v['tokens_per_exec_k']:10.0f} "
              f"{100 * v['timeout_share']:7.0f}% {v['completed_per_h']:7.1f} {v['utilisation']:5.2f} "
              f"{v['evictions_per_exec']:10.1f} {v['reprefill_per_trained']:9.2f}x "
              f"{v['mean_decode_batch']:6.0f} {v['switches']:8.0f}{extra}")  # fmt: skip
    print("   step length, mean / longest (h): " + ", ".join(
        f"{label.split(' (')[0]} {p[k]['mean_step_h']:.2f} / {p[k]['max_step_h']:.2f}"
        for k, label in labels.items()) + f"; groups carried per step (elastic) "
        f"{p['elastic']['carried_per_step']:.1f}")  # fmt: skip
    print("   async splits (R rollout cells: equal-work h): "
          + ", ".join(f"{r}: {h:.1f}" for r, h in res["async_splits"].items()))  # fmt: skip
    print(f"   lower bound (any policy, own work): {res['lower_bound_h']:.1f} h")
    if res["timeouts_differ"]:
        print(f"   ! timeout shares differ by {100 * res['timeout_spread']:.0f} points across "
              "the policies: equal-work hours compare executions cut at different lengths; "
              "read completed executions per hour (done/h) and tokens per execution beside them")  # fmt: skip
    rep = sc.reported
    st = res["steady"]
    print("   elastic's speedup, equal work (= tokens/h), mean +- SE over seeds: whole run | "
          "steady (even windows inside steps 1..N-2)")  # fmt: skip
    print(f"     vs colocate                  {pm(res['vs_colocate'])} | {pm(st['vs_colocate'])}"
          f"   (reported {fmt_range(rep['vs_colocate'])} in hours; staleness {staleness} vs 0)")  # fmt: skip
    print(f"     vs colocate, equal staleness {pm(res['vs_colocate_equal_staleness'])} | "
          f"{pm(st['vs_colocate_equal_staleness'])}   (elastic at staleness 0)")  # fmt: skip
    print(f"     vs async, half split         {pm(res['vs_async_half'])} | "
          f"{pm(st['vs_async_half'])}   (reported {fmt_range(rep['vs_async'])} in hours)")  # fmt: skip
    print(f"     vs async, best split         {pm(res['vs_async_best'])} | "
          f"{pm(st['vs_async_best'])}")  # fmt: skip
    print(f"   (end-to-end hours, not like for like: vs colocate {pm(res['hours_vs_colocate'])}, "
          f"vs async half {pm(res['hours_vs_async_half'])})")  # fmt: skip
    for a in res["assumptions"]:
        print(f"   - {a}")


def add_carry_flags(ap) -> None:
    """Carry-over for every policy alike (PolicyParams.close_share / max_carry / close_on);
    the defaults are the run config's (PolicyParams')."""
    d = PolicyParams()
    ap.add_argument("--close-share", type=float, default=d.close_share,
                    help="a step closes once this share of its groups has finished; the rest "
                    "carry over to the next step (1.0 = off, every policy waits for all; "
                    f"default {d.close_share}, the run config's)")  # fmt: skip
    ap.add_argument("--max-carry", type=int, default=d.max_carry,
                    help="steps a group may be carried")  # fmt: skip
    ap.add_argument("--close-on", default=d.close_on, choices=CLOSE_ON,
                    help="finished groups counted towards the share: the step's own, or every "
                    f"group it trains (carried-in ones included; default {d.close_on!r})")  # fmt: skip


def with_carry(sc, args):
    """The scenario with the carry-over flags in its policy parameters (every policy's)."""
    params = dataclasses.replace(sc.params, close_share=args.close_share,
                                 max_carry=args.max_carry, close_on=args.close_on)  # fmt: skip
    return dataclasses.replace(sc, params=params)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24,
                    help="steps per scenario (default 24; the scenarios define 24-48; short "
                    "runs weigh the pipeline's fill and drain more, see 'steady')")  # fmt: skip
    ap.add_argument("--seeds", type=int, default=3, help="workload seeds per scenario")
    ap.add_argument("--scenario", default="", help="run only scenarios whose name contains this")
    ap.add_argument("--handover", choices=("migrate", "reprefill"), default="migrate",
                    help="how a cell leaving rollout hands its contexts over "
                    "(scheduler.handover's default: migrate)")  # fmt: skip
    ap.add_argument("--admission", choices=("resident", "fifo"), default="resident",
                    help="memory model's admission: keep contexts resident, or FIFO per request "
                    "with LRU eviction (the previous model)")  # fmt: skip
    ap.add_argument("--no-memory", action="store_true",
                    help="the previous model: no KV limit, a global free prefix cache, 64 slots")  # fmt: skip
    ap.add_argument("--splits", default="",
                    help="comma-separated async splits to sweep (default: every 1..K-1)")  # fmt: skip
    ap.add_argument("--load", type=int, default=1,
                    help="multiply every scenario's executions per step (its replication; "
                    "the cluster stays the same)")  # fmt: skip
    add_carry_flags(ap)
    args = ap.parse_args()
    splits = [int(x) for x in args.splits.split(",") if x] or None
    rows, t0 = [], time.time()
    common = [a.replace("{handover}", args.handover).replace("{admission}", ADMISSION[args.admission])
              for a in MEMORY_ASSUMPTIONS]  # fmt: skip
    if args.no_memory:
        common = [common[-2], common[-1], "No memory model (--no-memory): the previous model."]
    for sc in load_scenarios(args.steps):
        if args.scenario.lower() not in sc.name.lower():
            continue
        sc = with_carry(dataclasses.replace(sc, replication=sc.replication * args.load), args)
        if args.no_memory:
            cost, mem, real = plain_cost(sc), None, None
        else:
            cost, mem, real = memory_cost(sc.calibration, sc.replication, args.handover,
                                          args.admission)  # fmt: skip
        res = run_scenario(sc, args.seeds, cost, splits)
        # The scenario's own assumptions, less the cell capacity the memory model replaces.
        own = [a for a in sc.assumptions if args.no_memory or "(cell_capacity)" not in a]
        res["assumptions"] = own + common
        if mem is not None:
            res["memory"] = {
                "cell_gb": mem.total_bytes / 1e9,
                "weights_gb": mem.weight_bytes / 1e9,
                "kv_pool_gb": mem.kv_pool_bytes / 1e9,
                "kv_tokens_m": mem.kv_tokens / 1e6,
                "kv_bytes_per_token": mem.kv_bytes_per_token,
                "mean_peak_context_k": res["mean_peak_context"] / 1e3,
                "contexts_per_cell": mem.kv_tokens / res["mean_peak_context"],
            }
        rows.append(res)
        print_scenario(sc, res, mem, real, sc.params.max_staleness)
    print(f"\n({time.time() - t0:.1f} s)")
    print(json.dumps({"scenarios": rows, "handover": args.handover, "admission": args.admission,
                      "close_share": args.close_share, "max_carry": args.max_carry,
                      "close_on": args.close_on,
                      "memory": not args.no_memory, "seconds": round(time.time() - t0, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
