"""Cost models for the simulator: fitted from measured timings, or projected from hardware.

A calibration is a JSON file under ``gyre/elastic/calibrations/`` with a mandatory ``source``
(where the figures come from) and a ``kind``:

- ``"measured"``: timings of the real programs, fitted by least squares.
    decode:  [{"batch": b, "context_tokens": sum of contexts in the batch, "step_s": t}, ...]
             fits step_s = base + per_seq * batch + per_ctx * context_tokens (non-negative
             least squares: a busier step never comes out cheaper); rows that all carry
             ``"context_max"`` (the longest context in the batch) also fit a per_max_ctx
             term (an engine whose step follows the longest context: live KV blocks)
    prefill: [{"tokens": n, "seconds": t}, ...]  fits seconds = per_token * tokens
    train:   [{"tokens": n, "seconds": t}, ...]  fits seconds = per_token * tokens (one cell)
    ``"intercepts": true`` fits prefill and train with a fixed cost each instead:
    seconds = prefill_call_s + per_token * tokens and seconds = microbatch_s + per_token *
    tokens (a fixed-shape program costs about the same however full it is), and optional
    ``step``: [{"optimizer_s", "publish_s", "checkpoint_s"}, ...] (medians are taken) and
    ``switch``: [{"seconds": t}, ...] (median, both directions) give the per-step and
    role-switch costs.
- ``"hardware"``: published device figures and a model shape, projected with roofline
  estimates (decode reads all weights once per step and each request's KV cache; prefill and
  training are compute bound at the stated utilisation).

Both take a ``fixed`` section for what is not fitted (switch costs, optimizer and publication
time, slots, micro-batch tokens, cell_capacity). Fixed keys override fitted ones.

A measured calibration may name a ``base`` (another calibration, by name or path): the base's
cost model supplies every cost this file does not measure, so only ``decode`` is then required
(``benchmarks/decode.py --write-calibration`` writes such a file: the decode curve of one cell
under load, with prefill and training from ``cpu_measured``). Rows are checked: every field
present, a finite number, not negative, and a decode row's batch at least 1.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import numpy as np

from gyre.elastic.sim import CostModel

CALIBRATIONS_DIR = os.path.join(os.path.dirname(__file__), "calibrations")
_FIXED_KEYS = {f.name for f in dataclasses.fields(CostModel)} - {"source"}
DECODE_COLS = ("batch", "context_tokens", "step_s")
# How deep ``base`` references may chain (a file naming itself, directly or not, is an error).
_MAX_BASE_DEPTH = 8


def _rows(meas: dict, key: str, cols: tuple[str, ...]) -> np.ndarray:
    """[N, len(cols)] floats of section ``key``; a clear error names the row and field at fault."""
    rows = meas.get(key)
    if not rows:
        raise ValueError(f"calibration has no '{key}' measurements")
    if not isinstance(rows, list):
        raise ValueError(f"calibration '{key}' must be a list of rows, got {type(rows).__name__}")
    out = np.empty((len(rows), len(cols)))
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"calibration '{key}' row {i} must be an object, got {row!r}")
        for j, col in enumerate(cols):
            if col not in row:
                raise ValueError(f"calibration '{key}' row {i} lacks field '{col}'")
            try:
                value = float(row[col])
            except (TypeError, ValueError):
                value = float("nan")
            if not np.isfinite(value) or isinstance(row[col], bool):
                raise ValueError(
                    f"calibration '{key}' row {i} field '{col}' must be a finite number, "
                    f"got {row[col]!r}"
                )
            if value < 0:
                raise ValueError(
                    f"calibration '{key}' row {i} field '{col}' must be >= 0, got {value}"
                )
            out[i, j] = value
    if key == "decode" and np.any(out[:, 0] < 1):
        i = int(np.argmax(out[:, 0] < 1))
        raise ValueError(
            f"calibration 'decode' row {i} field 'batch' must be >= 1, got {out[i, 0]}"
        )
    return out


def _slope(xy: np.ndarray, name: str) -> float:
    """Least-squares slope through the origin (no fixed cost is modelled for these)."""
    x, y = xy[:, 0], xy[:, 1]
    if not np.any(x > 0):
        raise ValueError(f"calibration '{name}' needs at least one row with tokens > 0")
    return float(np.dot(x, y) / np.dot(x, x))


def _linear(xy: np.ndarray, name: str) -> tuple[float, float]:
    """Least-squares (intercept, slope), both clipped at 0; one distinct x gives slope 0."""
    x, y = xy[:, 0], xy[:, 1]
    if len(np.unique(x)) < 2:
        return max(float(np.mean(y)), 0.0), 0.0
    coef, *_ = np.linalg.lstsq(np.column_stack([np.ones_like(x), x]), y, rcond=None)
    intercept, slope = (max(float(c), 0.0) for c in coef)
    if slope == 0.0:  # the clipped slope: refit the intercept alone
        intercept = max(float(np.mean(y)), 0.0)
    elif intercept == 0.0:
        slope = _slope(xy, name)
    return intercept, slope


def _median(meas: dict, key: str, field: str) -> float:
    vals = [float(r[field]) for r in meas.get(key, []) if field in r]
    return float(np.median(vals)) if vals else 0.0


def _fit_decode(dec: np.ndarray) -> tuple[float, ...]:
    """Coefficients >= 0 by least squares over rows (batch, context_tokens, [context_max,]
    seconds) -> (base, per_seq, per_ctx[, per_max_ctx]).

    Non-negative least squares, exactly: the best least-squares fit over the subsets of the
    terms whose coefficients all come out >= 0 (a negative one is noise around zero, and
    would make a busier step cheaper). Equals the plain fit whenever that is >= 0.
    """
    design = np.column_stack([np.ones(len(dec)), dec[:, :-1]])
    y = dec[:, -1]
    k = design.shape[1]
    best, best_sse = np.zeros(k), float(np.dot(y, y))
    for mask in itertools.product((True, False), repeat=k):  # the full model first
        cols = np.flatnonzero(mask)
        if not cols.size:
            continue
        coef, *_ = np.linalg.lstsq(design[:, cols], y, rcond=None)
        if np.any(coef < 0):
            continue
        full = np.zeros(k)
        full[cols] = coef
        sse = float(np.sum((design @ full - y) ** 2))
        if sse < best_sse * (1 - 1e-9):  # a simpler model wins only by fitting better
            best, best_sse = full, sse
    return tuple(float(c) for c in best)


def _decode_fields(meas: dict) -> dict:
    """The decode terms of a measured calibration (with per_max_ctx when every row has it)."""
    rows = meas.get("decode")
    with_max = (
        bool(rows)
        and isinstance(rows, list)
        and all(isinstance(r, dict) and "context_max" in r for r in rows)
    )
    cols = ("batch", "context_tokens", "context_max", "step_s") if with_max else DECODE_COLS
    coef = _fit_decode(_rows(meas, "decode", cols))
    names = ("decode_base_s", "decode_per_seq_s", "decode_per_ctx_token_s",
             "decode_per_max_ctx_token_s")  # fmt: skip
    return dict(zip(names, coef))


def fit(meas: dict, _chain: tuple[str, ...] = ()) -> CostModel:
    """Least-squares fit of a cost model from measured timings (``kind: measured``).

    With a ``base``, the sections absent here (prefill, train, step, switch) keep the base's
    costs; a section present here is fitted and replaces them.
    """
    base_cost = _load_base(meas, _chain) if "base" in meas else None
    fields = _decode_fields(meas)
    if base_cost is not None:
        fields = {**{k: getattr(base_cost, k) for k in _FIXED_KEYS}, **fields}
    for key, fixed, per_token in (
        ("prefill", "prefill_call_s", "prefill_per_token_s"),
        ("train", "microbatch_s", "train_per_token_s"),
    ):
        if base_cost is not None and key not in meas:
            continue
        xy = _rows(meas, key, ("tokens", "seconds"))
        if meas.get("intercepts"):
            fields[fixed], fields[per_token] = _linear(xy, key)
        else:  # no fixed cost: a base's would belong to another fit
            fields[fixed], fields[per_token] = 0.0, _slope(xy, key)
    for key in ("optimizer_s", "publish_s", "checkpoint_s"):
        if meas.get("step"):
            fields[key] = _median(meas, "step", key)
    if meas.get("switch"):
        fields["switch_r2t_s"] = fields["switch_t2r_s"] = _median(meas, "switch", "seconds")
    return _finish(fields, meas)


def project(spec: dict) -> CostModel:
    """Roofline projection from published figures (``kind: hardware``)."""
    try:
        hw, model, eff = spec["hardware"], spec["model"], spec["efficiency"]
        n = hw["devices_per_cell"]
        bw, flops = n * hw["hbm_bytes_per_s"], n * hw["flops_per_s"]
        weight_bytes = model["total_params"] * model["bytes_per_param"]
        active = model["active_params"]
        # Causal attention over an average training context, forward + backward (x3).
        attn = 3 * 2 * model["layers"] * model["attn_dim"] * model["mean_train_context"]
        fields = dict(
            decode_base_s=weight_bytes / (bw * eff["decode_bandwidth"]),
            decode_per_seq_s=2 * active / (flops * eff["decode_mfu"]),
            decode_per_ctx_token_s=model["kv_bytes_per_token"] / (bw * eff["decode_bandwidth"]),
            prefill_per_token_s=2 * active / (flops * eff["prefill_mfu"]),
            train_per_token_s=(model["train_flops_per_param"] * active + attn)
            / (flops * eff["train_mfu"]),
        )
    except KeyError as e:
        raise ValueError(f"hardware calibration lacks field {e}") from e
    return _finish(fields, spec)


def _finish(fields: dict, spec: dict) -> CostModel:
    fixed = spec.get("fixed", {})
    unknown = set(fixed) - _FIXED_KEYS
    if unknown:
        raise ValueError(f"calibration 'fixed' has unknown keys {sorted(unknown)}")
    return CostModel(**{**fields, **fixed, "source": spec["source"]})


def from_dict(spec: dict, _chain: tuple[str, ...] = ()) -> CostModel:
    if not isinstance(spec, dict):
        raise ValueError(f"a calibration is a JSON object, got {type(spec).__name__}")
    if not spec.get("source"):
        raise ValueError("calibration lacks a 'source' field saying where its figures come from")
    kind = spec.get("kind")
    if kind not in ("measured", "hardware"):
        raise ValueError(
            f"calibration 'kind' must be one of ['hardware', 'measured'], got {kind!r}"
        )
    if kind == "hardware":
        if "base" in spec:
            raise ValueError("calibration 'base' is for measured calibrations only")
        return project(spec)
    return fit(spec, _chain)


def _path(name_or_path: str) -> str:
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(CALIBRATIONS_DIR, name_or_path.removesuffix(".json") + ".json")
    if not os.path.exists(path):
        raise ValueError(f"no calibration {name_or_path!r} (looked in {CALIBRATIONS_DIR})")
    return path


def load(name_or_path: str, _chain: tuple[str, ...] = ()) -> CostModel:
    """A calibration file by path, or by name under gyre/elastic/calibrations/."""
    path = _path(name_or_path)
    try:
        with open(path) as f:
            spec = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration {path}: not valid JSON ({e})") from e
    try:
        return from_dict(spec, (*_chain, os.path.realpath(path)))
    except ValueError as e:
        if str(e).startswith("calibration "):
            raise ValueError(f"{path}: {e}") from e
        raise


def _load_base(meas: dict, chain: tuple[str, ...]) -> CostModel:
    """The cost model of ``meas['base']`` (a name or path), refusing cycles."""
    name = meas["base"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"calibration 'base' must name a calibration, got {name!r}")
    path = os.path.realpath(_path(name))
    if path in chain:
        raise ValueError(f"calibration 'base' {name!r} refers back to itself ({path})")
    if len(chain) >= _MAX_BASE_DEPTH:
        raise ValueError(f"calibration 'base' {name!r}: more than {_MAX_BASE_DEPTH} bases chained")
    return load(path, chain)


def measurements(
    cost: CostModel, batches=(1, 8, 32), contexts=(1_000, 50_000), noise: float = 0.0, seed: int = 0
) -> dict:
    """Synthetic timings of a known cost model (for testing the fit; never a calibration)."""
    rng = np.random.default_rng(seed)
    jitter = lambda t: float(t * (1 + noise * rng.standard_normal()))
    return {
        "source": "synthetic",
        "kind": "measured",
        "decode": [
            {"batch": b, "context_tokens": b * c, "step_s": jitter(cost.decode_step_s(b, b * c))}
            for b in batches
            for c in contexts
        ],
        "prefill": [
            {"tokens": n, "seconds": jitter(n * cost.prefill_per_token_s)} for n in (128, 4096)
        ],
        "train": [
            {"tokens": n, "seconds": jitter(n * cost.train_per_token_s)} for n in (1024, 65536)
        ],
    }


def fit_run(engine_steps: list[dict], steps: list[dict], base: CostModel, source: str) -> CostModel:
    """Fits a cost model from the timings of a real controller run (in situ).

    The programs are timed where they run, beside the other cells, the harness and the
    checkpoint writer, so the model includes what isolated timings miss. ``engine_steps``:
    one row per ``Engine.step``: chunks (prefill chunks it ran), batch and context_tokens
    (its decode, batch 0 for none) and seconds. ``steps``: one row per RL step: wall_s,
    engine_s, train_s (gradient dispatch + optimizer step + publication), checkpoint_s,
    microbatches and calls. Fitted:

    - decode: least squares of the pure-decode engine steps (base + per_seq * batch +
      per_ctx * context), as in :func:`fit`;
    - prefill: the rest of the prefilling engine steps' time, per chunk token (ratio of sums);
    - train: a fixed cost per micro-batch (the programs have fixed shapes) that carries the
      optimizer and the publication too;
    - checkpoint: the mean save;
    - host time outside every program (the harness, the trajectory processor, the event
      loop): a fixed cost per model call, as ``prefill_call_s``.

    Means, not medians: the prediction is of a total, and the total carries the bursts.
    Everything else (slots, chunk, switch costs, ...) comes from ``base``.
    """
    if not steps or not engine_steps:
        raise ValueError("fit_run needs engine steps and RL steps to fit")
    chunk = base.prefill_chunk
    if chunk <= 0:
        raise ValueError("fit_run models the engine's chunked prefill: base.prefill_chunk > 0")
    rows = np.array([[r["chunks"], r["batch"], r["context_tokens"], r["seconds"]]
                     for r in engine_steps], float)  # fmt: skip
    dec = rows[(rows[:, 0] == 0) & (rows[:, 1] > 0)]
    if len(dec) < 3:
        raise ValueError(f"fit_run needs at least 3 pure decode steps, got {len(dec)}")
    d_base, per_seq, per_ctx = _fit_decode(dec[:, 1:])
    pre = rows[rows[:, 0] > 0]
    decode_s = np.where(pre[:, 1] > 0, d_base + per_seq * pre[:, 1] + per_ctx * pre[:, 2], 0.0)
    per_token = max(float(np.sum(pre[:, 3] - decode_s)), 0.0) / (chunk * pre[:, 0].sum() or 1)
    total = lambda key: float(sum(s[key] for s in steps))
    host = total("wall_s") - total("engine_s") - total("train_s") - total("checkpoint_s")
    return dataclasses.replace(
        base,
        decode_base_s=d_base,
        decode_per_seq_s=per_seq,
        decode_per_ctx_token_s=per_ctx,
        prefill_per_token_s=per_token,
        prefill_call_s=max(host, 0.0) / max(total("calls"), 1),
        train_per_token_s=0.0,
        microbatch_s=total("train_s") / max(total("microbatches"), 1),
        optimizer_s=0.0,
        publish_s=0.0,
        checkpoint_s=total("checkpoint_s") / len(steps),
        source=source,
    )
