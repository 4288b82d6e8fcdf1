"""Cost models for the simulator: fitted from measured timings, or projected from hardware.

A calibration is a JSON file under ``gyre/elastic/calibrations/`` with a mandatory ``source``
(where the figures come from) and a ``kind``:

- ``"measured"``: timings of the real programs, fitted by least squares.
    decode:  [{"batch": b, "context_tokens": sum of contexts in the batch, "step_s": t}, ...]
             fits step_s = base + per_seq * batch + per_ctx * context_tokens
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
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from gyre.elastic.sim import CostModel

CALIBRATIONS_DIR = os.path.join(os.path.dirname(__file__), "calibrations")
_FIXED_KEYS = {f.name for f in dataclasses.fields(CostModel)} - {"source"}


def _rows(meas: dict, key: str, cols: tuple[str, ...]) -> np.ndarray:
    rows = meas.get(key)
    if not rows:
        raise ValueError(f"calibration has no '{key}' measurements")
    try:
        return np.array([[float(r[c]) for c in cols] for r in rows])
    except KeyError as e:
        raise ValueError(f"calibration '{key}' row lacks field {e}") from e


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


def fit(meas: dict) -> CostModel:
    """Least-squares fit of a cost model from measured timings (``kind: measured``)."""
    dec = _rows(meas, "decode", ("batch", "context_tokens", "step_s"))
    design = np.column_stack([np.ones(len(dec)), dec[:, 0], dec[:, 1]])
    coef, *_ = np.linalg.lstsq(design, dec[:, 2], rcond=None)
    # A negative coefficient is noise around zero; clipping keeps the cost monotone.
    base, per_seq, per_ctx = (max(float(c), 0.0) for c in coef)
    prefill = _rows(meas, "prefill", ("tokens", "seconds"))
    train = _rows(meas, "train", ("tokens", "seconds"))
    fields = dict(decode_base_s=base, decode_per_seq_s=per_seq, decode_per_ctx_token_s=per_ctx)
    if meas.get("intercepts"):
        fields["prefill_call_s"], fields["prefill_per_token_s"] = _linear(prefill, "prefill")
        fields["microbatch_s"], fields["train_per_token_s"] = _linear(train, "train")
    else:
        fields["prefill_per_token_s"] = _slope(prefill, "prefill")
        fields["train_per_token_s"] = _slope(train, "train")
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


def from_dict(spec: dict) -> CostModel:
    if not spec.get("source"):
        raise ValueError("calibration lacks a 'source' field saying where its figures come from")
    kinds = {"measured": fit, "hardware": project}
    if spec.get("kind") not in kinds:
        raise ValueError(
            f"calibration 'kind' must be one of {sorted(kinds)}, got {spec.get('kind')!r}"
        )
    return kinds[spec["kind"]](spec)


def load(name_or_path: str) -> CostModel:
    """A calibration file by path, or by name under gyre/elastic/calibrations/."""
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(CALIBRATIONS_DIR, name_or_path.removesuffix(".json") + ".json")
    if not os.path.exists(path):
        raise ValueError(f"no calibration {name_or_path!r} (looked in {CALIBRATIONS_DIR})")
    with open(path) as f:
        return from_dict(json.load(f))


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
