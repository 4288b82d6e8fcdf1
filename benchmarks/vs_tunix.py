"""Gyre's rollout engine vs Tunix's sampler on one Qwen3 checkpoint, alternating in one process.

One random-init Qwen3 (hidden 256, 4 layers, 8 query / 4 kv heads of 32, MLP 768, vocab 4096,
float32) is written once as config.json + model.safetensors (``gyre.model.hf_dir.save``), and
both sides load that folder: Tunix with ``tunix.models.qwen3.params``, Gyre with
``gyre.model.hf_dir.load``. One CPU device, greedy, ``--new`` new tokens with no stop token,
the same random prompts on both sides. For each (batch B, prompt P): Gyre's engine with
slots = B and max_len = P + new; Tunix's ``Sampler`` with cache_size = P + new (its cache holds
the prompt plus every sampled token; that is the smallest it accepts), so both hold the same
KV. Each side warms up once (compile excluded), then Gyre and Tunix run alternately
``--runs`` times; figures are medians.

Per row: tok/s = B * new / wall time of the whole call (prefill + decode, tokens on the host);
first = wall time of the same call with 1 new token (prefill and the first token); decode
tok/s = B * (new - 1) / (whole - first), medians of each, the same public calls on both
sides (Gyre may run prefill and decode loops in one step, so there is no split to time
inside a call); best = the decode ratio from the fastest whole and first calls of each
side instead of the medians (a shared machine's other tenants only slow runs down); match
= leading tokens identical between the sides, min over rows and runs (= new when every
greedy token agrees). Every Gyre run uses a fresh engine, so no KV from an earlier
run is reused (prompts within a batch are distinct, so nothing is shared either).

Compile settings: Gyre's one-slot engine compiles its programs with 512-bit vectors on CPU
(``rollout.cpu_vector_width`` auto, gyre/rollout/programs.py); Tunix's programs get XLA's
defaults. To give Tunix the same width, set it for the whole process:
``XLA_FLAGS=--xla_cpu_prefer_vector_width=512`` (recorded as "xla_flags"). The batch-1
floor is timed both ways.

Tunix (``google-tunix``) is an optional dependency; without it the script prints how to
install it and a JSON line with "skipped", and exits 0. Tunix's ``import`` sets flax's
global ``flax_always_shard_variable`` to False; it is imported before any Gyre model exists.

    # in a venv with google-tunix and Gyre's requirements (jax/flax as in requirements.txt)
    PYTHONPATH=. python benchmarks/vs_tunix.py [--quick]
        [--batches 1,8,32] [--prompts 64,512] [--new 128] [--runs 3] [--decode-steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from gyre import mesh as gmesh
from gyre.config import default_config
from gyre.model import decoder as gdec
from gyre.model import hf_dir
from gyre.rl.builder import build_specs
from gyre.rollout.engine import Engine
from gyre.rollout.programs import RolloutSpec, compiler_options
from gyre.rollout.types import GenerateRequest

INSTALL = "pip install google-tunix  (an optional dependency, not in requirements.txt)"
# Tunix's attention ignores the config's rope_theta and always uses 1e6 (tunix 0.1.7,
# models/qwen3/model.py apply_rope), so the shared checkpoint uses that value.
ROPE_THETA = 1_000_000.0
FULL_MODEL = dict(vocab_size=4096, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4,
                  head_dim=32, d_ff=768)  # fmt: skip
QUICK_MODEL = dict(vocab_size=512, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, d_ff=128)  # fmt: skip


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        msg = f"{text!r} is not a comma-separated list of integers"
        raise argparse.ArgumentTypeError(msg) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values


def _positive_int(text: str) -> int:
    (value,) = _positive_ints(text)
    return value


def parse_args(argv=None) -> argparse.Namespace:
    """Flags -> namespace; --quick picks a tiny model and small sizes unless given explicitly."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="tiny model; batches 1,4, prompt 32, 16 new tokens")  # fmt: skip
    p.add_argument("--batches", type=_positive_ints, help="default 1,8,32 (quick: 1,4)")
    p.add_argument("--prompts", type=_positive_ints, help="prompt lengths; default 64,512")
    p.add_argument("--new", type=_positive_int, help="new tokens per request; default 128")
    p.add_argument("--runs", type=_positive_int, default=3, help="timed runs per side")
    p.add_argument("--decode-steps", type=_positive_int,
                   help="Gyre's RolloutSpec.decode_steps (default: the config's)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    args = p.parse_args(argv)
    q = args.quick
    args.batches = args.batches or ((1, 4) if q else (1, 8, 32))
    args.prompts = args.prompts or ((32,) if q else (64, 512))
    args.new = args.new or (16 if q else 128)
    if args.decode_steps and "decode_steps" not in _spec_fields():
        p.error("--decode-steps: this Gyre's RolloutSpec has no field decode_steps")
    return args


def _spec_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(RolloutSpec)}


def load_tunix():
    """-> (tunix qwen3 model module, params module, sampler module), or None when absent.

    Imported before any Gyre model: the model module flips flax's flax_always_shard_variable.
    """
    try:
        return tuple(
            importlib.import_module(f"tunix.{name}")
            for name in ("models.qwen3.model", "models.qwen3.params", "generate.sampler")
        )
    except ImportError:
        return None


def base_config(quick: bool):
    """Gyre config with the benchmark's architecture (attention etc. stay the defaults)."""
    cfg = default_config()
    for key, value in (QUICK_MODEL if quick else FULL_MODEL).items():
        cfg.model[key] = value
    cfg.model.rope_theta, cfg.model.tie_embeddings, cfg.model.dtype = ROPE_THETA, False, "float32"
    return cfg


def write_checkpoint(folder: str, cfg, cell, seed: int) -> int:
    """Random-init weights of ``cfg.model`` -> folder/config.json + model.safetensors.

    Returns the number of parameters."""
    spec = build_specs(cfg).model
    _, state = gdec.init_sharded(spec, seed, cell, "rollout")
    hf_dir.save(folder, state, spec)
    return int(sum(x.size for x in jax.tree.leaves(state)))


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> np.ndarray:
    """int32[B, P] random token ids, the same for both sides."""
    rng = np.random.default_rng([seed, batch, prompt_len])
    return rng.integers(0, vocab, (batch, prompt_len)).astype(np.int32)


def match_length(a_BxN: np.ndarray, b_BxN: np.ndarray) -> int:
    """Leading tokens identical in every row: min over rows of the first differing index."""
    a_BxN, b_BxN = np.asarray(a_BxN), np.asarray(b_BxN)
    if a_BxN.shape != b_BxN.shape:
        raise ValueError(f"token arrays differ in shape: {a_BxN.shape} vs {b_BxN.shape}")
    # a column of differences past the end: a row that agrees everywhere "differs" at N
    diff_BxN1 = np.concatenate([a_BxN != b_BxN, np.ones((len(a_BxN), 1), bool)], axis=1)
    return int(np.argmax(diff_BxN1, axis=1).min(initial=a_BxN.shape[1]))


@dataclasses.dataclass
class Run:
    """One timed call: tokens int32[B, N] and its wall seconds."""

    tokens: np.ndarray
    seconds: float


class GyreSide:
    """Gyre's engine on ``folder``'s weights: slots = batch, max_len = prompt + new, greedy."""

    def __init__(self, folder: str, cfg, cell, batch: int, prompt_len: int, new: int,
                 decode_steps: int | None = None):  # fmt: skip
        cfg = cfg.copy_and_resolve_references()
        cfg.rollout.slots, cfg.rollout.max_len = batch, prompt_len + new
        cfg.rollout.temperature = 0.0
        model, self.state, _ = hf_dir.load(folder, build_specs(cfg).model, cell, "rollout")
        spec = dataclasses.replace(build_specs(cfg).rollout, model=model)
        if decode_steps:
            spec = dataclasses.replace(spec, decode_steps=decode_steps)
        self.spec, self.cell = spec, cell
        self.calls = 0

    @property
    def decode_steps(self) -> int:
        """Tokens per decode dispatch (1 for an engine without the field; auto resolved)."""
        steps = getattr(self.spec, "decode_steps", 1)
        if steps == -1:
            from gyre.rollout.programs import loop_steps

            return loop_steps(self.spec)
        return steps

    def run(self, prompts_BxP: np.ndarray, new: int) -> Run:
        """``new`` (<= the constructor's) greedy tokens for every prompt row."""
        engine = Engine(self.spec, self.cell, self.state)  # fresh: no KV left from a run before
        engine.warmup()
        self.calls += 1
        reqs = [GenerateRequest(f"vs_tunix{i}", self.calls, p, new, temperature=0.0)
                for i, p in enumerate(prompts_BxP)]  # fmt: skip
        start = time.perf_counter()
        rids = [engine.submit(r) for r in reqs]
        out = engine.run_until_done()
        seconds = time.perf_counter() - start
        return Run(np.stack([np.asarray(out[rid].tokens) for rid in rids]), seconds)


class _IdTokenizer:
    """Tunix tokenizer over prompts given as ids: ``encode(key)`` looks the row up, so Tunix's
    timed call does no text work. pad -1 and eos = vocab are ids the model never emits (a
    generated pad would be masked out of attention; an eos would stop the row)."""

    def __init__(self, vocab: int):
        self.rows: dict[str, list[int]] = {}
        self.eos = vocab

    def encode(self, key: str, **_) -> list[int]:
        return self.rows[key]

    def decode(self, ids, **_) -> str:
        return ""

    def bos_id(self):
        return None

    def eos_id(self) -> int:
        return self.eos

    def pad_id(self) -> int:
        return -1


class TunixSide:
    """Tunix's Qwen3 + Sampler on ``folder``'s weights, cache_size = prompt + new, greedy."""

    def __init__(self, tunix, folder: str, batch: int, prompt_len: int, new: int):
        model_lib, params_lib, sampler_lib = tunix
        with open(os.path.join(folder, "config.json")) as f:
            hf = json.load(f)
        config = model_lib.ModelConfig(
            num_layers=hf["num_hidden_layers"],
            vocab_size=hf["vocab_size"],
            embed_dim=hf["hidden_size"],
            hidden_dim=hf["intermediate_size"],
            num_heads=hf["num_attention_heads"],
            head_dim=hf["head_dim"],
            num_kv_heads=hf["num_key_value_heads"],
            rope_theta=int(hf["rope_parameters"]["rope_theta"]),
            norm_eps=hf["rms_norm_eps"],
            use_tied_embedding=hf["tie_word_embeddings"],
        )
        model = params_lib.create_model_from_safe_tensors(folder, config, mesh=None)
        self.cache_size = prompt_len + new
        cache = sampler_lib.CacheConfig(
            cache_size=self.cache_size,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
        )
        self.tokenizer = _IdTokenizer(config.vocab_size)
        self.sampler = sampler_lib.Sampler(model, self.tokenizer, cache)
        self.prompt_len = prompt_len

    def run(self, prompts_BxP: np.ndarray, new: int) -> Run:
        """``new`` (<= the constructor's) greedy tokens for every prompt row."""
        keys = [f"row{i}" for i in range(len(prompts_BxP))]
        self.tokenizer.rows = {k: p.tolist() for k, p in zip(keys, prompts_BxP)}
        start = time.perf_counter()
        out = self.sampler(
            keys,
            max_generation_steps=new,
            max_prompt_length=self.prompt_len,
            eos_tokens=[self.tokenizer.eos],
            temperature=0.0,
        )
        tokens = np.stack([np.asarray(t, np.int32) for t in out.tokens])
        return Run(tokens, time.perf_counter() - start)


def rates(whole: list[Run], first: list[Run], batch: int, new: int) -> dict:
    """Median seconds of the whole calls and of the 1-token calls -> tok/s figures; and the
    decode rate from the fastest of each (other tenants of a shared machine only ever slow
    a run down, so the fastest is the least disturbed)."""

    def decode(whole_s, first_s):  # None when noise makes the difference meaningless
        d = whole_s - first_s
        return batch * (new - 1) / d if new > 1 and d > 0 else None

    whole_s = statistics.median(r.seconds for r in whole)
    first_s = statistics.median(r.seconds for r in first)
    return {
        "tok_s": batch * new / whole_s,
        "first_s": first_s,
        "decode_tok_s": decode(whole_s, first_s),
        "best_decode_tok_s": decode(min(r.seconds for r in whole), min(r.seconds for r in first)),
    }


def compare(tunix, folder, cfg, cell, batch, prompt_len, new, runs, decode_steps=None) -> dict:
    """One row: warm both sides, alternate ``runs`` timed calls, medians and match length."""
    prompts = make_prompts(batch, prompt_len, cfg.model.vocab_size, batch * 7919 + prompt_len)
    sides = {
        "gyre": GyreSide(folder, cfg, cell, batch, prompt_len, new, decode_steps),
        "tunix": TunixSide(tunix, folder, batch, prompt_len, new),
    }
    whole = {name: [] for name in sides}
    first = {name: [] for name in sides}
    for _ in range(runs + 1):  # round 0 warms up (compiles) and is not timed
        for name, side in sides.items():  # alternate: gyre, tunix, gyre, tunix
            whole[name].append(side.run(prompts, new))
            first[name].append(side.run(prompts, 1))
    match = min(match_length(g.tokens, t.tokens) for g, t in zip(whole["gyre"], whole["tunix"]))
    g = rates(whole["gyre"][1:], first["gyre"][1:], batch, new)
    t = rates(whole["tunix"][1:], first["tunix"][1:], batch, new)
    ratio = lambda a, b: None if a is None or b is None else round(a / b, 3)
    r1 = lambda v: None if v is None else round(v, 1)
    return {
        "batch": batch,
        "prompt": prompt_len,
        "gyre_tok_s": r1(g["tok_s"]),
        "tunix_tok_s": r1(t["tok_s"]),
        "ratio": ratio(g["tok_s"], t["tok_s"]),
        "gyre_first_ms": round(1e3 * g["first_s"], 2),
        "tunix_first_ms": round(1e3 * t["first_s"], 2),
        "gyre_decode_tok_s": r1(g["decode_tok_s"]),
        "tunix_decode_tok_s": r1(t["decode_tok_s"]),
        "decode_ratio": ratio(g["decode_tok_s"], t["decode_tok_s"]),
        "best_decode_ratio": ratio(g["best_decode_tok_s"], t["best_decode_tok_s"]),
        "match": match,
        "gyre_runs_s": [round(r.seconds, 4) for r in whole["gyre"][1:]],
        "tunix_runs_s": [round(r.seconds, 4) for r in whole["tunix"][1:]],
        "gyre_decode_steps": sides["gyre"].decode_steps,
        "gyre_max_len": sides["gyre"].spec.max_len,
        "tunix_cache_size": sides["tunix"].cache_size,
    }


def matvec_shapes(m) -> list[tuple[int, int]]:
    """[in, out] of every weight matrix a batch-1 decode token multiplies by (model config
    ``m``): per layer q, k, v, o, gate, up, down, then the head."""
    d, qd, kvd, f = m.d_model, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.d_ff
    layer = [(d, qd), (d, kvd), (d, kvd), (qd, d), (d, f), (d, f), (f, d)]
    return layer * m.num_layers + [(d, m.vocab_size)]


def matvec_floor(m, runs: int, tokens: int = 128, options: dict | None = None) -> float:
    """tok/s of batch-1 decode if it were only the weight matrix-vector products of model
    config ``m`` (:func:`matvec_shapes`, float32, one jitted loop of ``tokens`` steps,
    compiled with XLA ``options``: none = XLA's defaults)."""
    *shapes, head_shape = matvec_shapes(m)
    d = m.d_model
    rng = np.random.default_rng(0)
    ws = [jax.numpy.asarray(rng.normal(0, d**-0.5, s), np.float32) for s in shapes]
    head = jax.numpy.asarray(rng.normal(0, d**-0.5, head_shape), np.float32)

    def token(_, x_1xD):
        for i in range(0, len(ws), 7):
            wq, wk, wv, wo, wg, wu, wd = ws[i : i + 7]
            kv = (x_1xD @ wk + x_1xD @ wv).sum() * 1e-6  # keeps k and v live
            x_1xD = x_1xD + (x_1xD @ wq + kv) @ wo
            x_1xD = x_1xD + (jax.nn.silu(x_1xD @ wg) * (x_1xD @ wu)) @ wd
            x_1xD = x_1xD / (1.0 + jax.numpy.abs(x_1xD).max())  # bounded: no inf over steps
        return x_1xD + (x_1xD @ head).max() * 1e-6

    loop = jax.jit(lambda x: jax.lax.fori_loop(0, tokens, token, x),
                   compiler_options=options or {})  # fmt: skip
    x = jax.numpy.ones((1, d), np.float32)
    loop(x).block_until_ready()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        loop(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return tokens / statistics.median(times)


def table(rows: list[dict]) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    head = (f"{'batch':>5} {'prompt':>6} {'gyre tok/s':>10} {'tunix tok/s':>11} {'ratio':>6} "
            f"{'first ms g/t':>13} {'gyre dec':>9} {'tunix dec':>9} {'dec ratio':>9} "
            f"{'best':>5} {'match':>5}")  # fmt: skip
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['batch']:>5} {r['prompt']:>6} {r['gyre_tok_s']:>10.1f} {r['tunix_tok_s']:>11.1f} "
            f"{fmt(r['ratio'], '.2f'):>6} "
            f"{r['gyre_first_ms']:>6.1f}/{r['tunix_first_ms']:<6.1f} "
            f"{fmt(r['gyre_decode_tok_s'], '.1f'):>9} "
            f"{fmt(r['tunix_decode_tok_s'], '.1f'):>9} {fmt(r['decode_ratio'], '.2f'):>9} "
            f"{fmt(r['best_decode_ratio'], '.2f'):>5} {r['match']:>5}"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    tunix = load_tunix()
    if tunix is None:
        figures = {"benchmark": "vs_tunix", "skipped": f"tunix is not installed: {INSTALL}"}
        print(f"vs_tunix: skipped, Tunix is not installed; to run it: {INSTALL}")
        print(json.dumps(figures))
        return figures
    cfg = base_config(args.quick)
    (cell,) = gmesh.make_cells(1, devices=jax.devices()[:1])
    with tempfile.TemporaryDirectory() as folder:
        params = write_checkpoint(folder, cfg, cell, args.seed)
        rows = [
            compare(tunix, folder, cfg, cell, b, p, args.new, args.runs, args.decode_steps)
            for p in args.prompts
            for b in args.batches
        ]
    m = cfg.model
    # Gyre's one-slot programs' XLA options (rollout.cpu_vector_width auto): the floor is
    # timed with XLA's defaults (what Tunix's programs get) and with those options.
    one_slot = dataclasses.replace(build_specs(cfg).rollout, slots=1)
    wide = compiler_options(one_slot, jax.devices()[0].platform)
    floor = matvec_floor(m, args.runs)
    floor_wide = matvec_floor(m, args.runs, options=wide) if wide else floor
    figures = {
        "benchmark": "vs_tunix",
        "device": f"{jax.devices()[0].platform} x1",
        "tunix_version": _version("google-tunix"),
        "jax_version": jax.__version__,
        "model": {k: m[k] for k in FULL_MODEL} | {"params": params},
        "new_tokens": args.new,
        "runs": args.runs,
        "greedy": True,
        # tokens per decode dispatch by batch (auto differs for a one-slot cell)
        "gyre_decode_steps": {r["batch"]: r["gyre_decode_steps"] for r in rows},
        "min_match": min(r["match"] for r in rows),
        "batch1_matvec_floor_tok_s": round(floor, 1),
        "batch1_matvec_floor_gyre_options_tok_s": round(floor_wide, 1),
        "gyre_batch1_compiler_options": wide,
        # process-wide XLA flags (both sides): e.g. Tunix given Gyre's width
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "rows": rows,
    }
    print(
        f"vs_tunix on one {jax.devices()[0].platform} device: Qwen3 {params / 1e6:.2f}M params "
        f"(d {m.d_model}, {m.num_layers} layers, {m.num_heads}/{m.num_kv_heads} heads of "
        f"{m.head_dim}, vocab {m.vocab_size}), greedy, {args.new} new tokens, median of "
        f"{args.runs}; Gyre max_len = Tunix cache_size = prompt + new; Gyre decode steps "
        f"per dispatch (by batch): "
        + ", ".join(f"{n} (B{b})" for b, n in figures["gyre_decode_steps"].items())
    )
    print(table(rows))
    print(f"greedy match (leading identical tokens, min over rows): {figures['min_match']}"
          f" of {args.new}")  # fmt: skip
    print(f"XLA_FLAGS (both sides): {figures['xla_flags'] or '-'}; Gyre's one-slot programs "
          f"also compile with {wide or 'no options'}")  # fmt: skip
    ones = ", ".join(
        f"prompt {r['prompt']}: Gyre {r['gyre_decode_tok_s'] / floor_wide:.2f}, Tunix "
        f"{r['tunix_decode_tok_s'] / floor:.2f}"
        for r in rows if r["batch"] == 1 and r["gyre_decode_tok_s"] and r["tunix_decode_tok_s"]
    )  # fmt: skip
    print(f"batch-1 floor (the weight matrix-vector products alone): {floor:.0f} tok/s with "
          f"XLA's defaults, {floor_wide:.0f} with Gyre's one-slot options"
          + (f"; batch-1 decode as a fraction of its own side's floor: {ones}" if ones else ""))  # fmt: skip
    print(json.dumps(figures))
    return figures


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main(sys.argv[1:])
