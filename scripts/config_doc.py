"""Writes docs/config.md, the reference of every config key, from the code: the keys and their
defaults from ``gyre.config.default_config``, the intervals from ``gyre.config.BOUNDS`` (the
table in gyre/bounds.py and those declared on spec fields), the choices from what
``gyre.config.validate`` accepts, and each key's meaning from, in this order, the comment on
its line in gyre/config.py (or the comment lines just above it), the comment on the spec
field it sets (gyre/rl/specs.py and each part's spec), or :data:`DESCRIPTIONS` below.
A section's introduction is the comment above its ``ConfigDict()`` line.

    python scripts/config_doc.py          # rewrites docs/config.md
    python scripts/config_doc.py --check  # exit 1 if docs/config.md is stale

tests/test_config_doc.py fails when docs/config.md is stale or a key has no meaning.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import pathlib
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "config.md"
sys.path.insert(0, str(ROOT))

# Meanings of keys whose comment in gyre/config.py or on their spec field is missing or too
# terse to stand alone (these win over the comments). A new key (or a new spec field behind
# one) needs a comment there or a line here.
DESCRIPTIONS = {
    "seed": "seed of the initial weights, the tasks of every step, sampling and the "
    "evaluation tasks",
    "name": "the experiment's name (console lines, summary, table header)",
    "model.vocab_size": "vocabulary size (the environment's for token tasks, the "
    "tokenizer's for chat tasks)",
    "model.d_model": "width of the residual stream",
    "model.num_layers": "decoder layers",
    "model.num_heads": "query heads per layer",
    "model.num_kv_heads": "key/value heads per layer (grouped-query attention)",
    "model.head_dim": "width of one attention head (even: rotary embeddings rotate pairs)",
    "model.d_ff": "hidden width of the feed-forward block",
    "model.rope_theta": "base of the rotary position embeddings",
    "model.rms_eps": "epsilon of the RMS norms",
    "model.tie_embeddings": "the output projection is the transposed input embedding",
    "trajectory.loss_mode": "how path losses are weighted and normalised "
    "(gyre/trajectory/advantages.py LOSS_MODES)",
    "trajectory.std_normalize": "divide group-relative advantages by the group's standard "
    "deviation",
    "train.lr": "learning rate of AdamW (after warm-up)",
    "train.warmup_steps": "optimizer steps of linear learning-rate warm-up",
    "train.weight_decay": "AdamW weight decay",
    "train.b1": "AdamW first-moment decay",
    "train.b2": "AdamW second-moment decay",
    "train.grad_clip": "global gradient-norm clip; 0 = off",
    "train.clip_low": "PPO ratio clip below 1 (ratio >= 1 - clip_low)",
    "train.clip_high": "PPO ratio clip above 1 (ratio <= 1 + clip_high)",
    "train.kl_coef": "coefficient of the KL penalty to the reference policy; 0 = off",
    "train.rows_per_microbatch": "packed rows per micro-batch (one gradient computation on "
    "one train cell); 0 = auto: the largest that fits the devices' memory by the plan "
    "(`python -m gyre.plan`), the default 4 where devices report none (CPU)",
    "train.max_bad_steps": "non-finite gradients in a row that stop the run (a bad step is "
    "skipped, weights kept)",
    "train.checkpoint_every": "checkpoint every N steps (and after the last, and on a stop "
    "request)",
    "train.keep_checkpoints": "checkpoints kept in <workdir>/checkpoints",
    "rollout.slots": "sequences decoded together per rollout cell",
    "rollout.max_len": "longest context a slot holds (prompt + completion), tokens",
    "rollout.prefill_chunk": "prompt tokens prefilled per chunk",
    "rollout.temperature": "sampling temperature of rollouts (0: greedy)",
    "rollout.top_p": "nucleus sampling mass of rollouts (1: off)",
    "rollout.max_new_tokens": "tokens one model call may generate",
    "agent.max_calls": "model calls an execution may make before it ends (timeout)",
    "agent.max_tokens": "tokens an execution may generate in all before it ends (timeout)",
    "agent.max_seconds": "wall seconds an execution may take before it ends (timeout)",
    "agent.max_retries": "retries of a model call whose output does not parse",
    "agent.context_window": "tokens of context before the harness compacts it",
    "agent.infra_retries": "retries of a tool call that crashed or hung (an infrastructure "
    "error, never the policy's)",
    "env.name": "the task environment (gyre/envs/registry.py ENVIRONMENTS)",
    "env.modulus": "ledger: arithmetic modulo this",
    "env.num_ops": "ledger: K, the operations of one task (each committed through a tool call)",
    "env.tool_latency": "mean seconds a tool call takes (simulated); 0 = instant",
    "model.attention": "attention implementation: block-sparse over the tree, or dense (the "
    "reference)",
    "trajectory.packing": "tree rows (shared prefixes computed once) or flat paths (ablation)",
    "trajectory.reward": "partial credit for milestones, or binary success (gyre/trajectory/"
    "advantages.py REWARDS)",
    "sft.steps": "supervised warm-start steps before RL; 0 = no warm start",
    "cluster.backend": "where the cells live: local (this process) or ray (actor processes)",
    "cluster.cells_per_actor": "ray: cells each actor owns (cells_per_actor x mesh.cell_size "
    "devices)",
    "run.entry": "what the experiment does: rl, sft, harness, smoke (gyre/run.py ENTRIES)",
    "run.tasks_per_step": "tasks drawn per RL step",
    "scheduler.calibration": "calibration whose training speed seeds each cell's train "
    "tokens/s (gyre/elastic/calibrations/<name>.json, or a path)",
    "scheduler.max_carry": "carry-over: steps a still-running group may be carried into "
    "(see scheduler.close_share)",
    "sft.lr": "learning rate of the warm start",
    "sft.eval_every": "warm-start steps between held-out accuracy checks",
}


def flat_defaults() -> dict[str, object]:
    """Every key of default_config() -> its default, in definition order."""
    from gyre.config import default_config

    out: dict[str, object] = {}

    def walk(d, prefix):
        for k in d.keys():
            v = d[k]
            if hasattr(v, "keys"):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v

    walk(default_config(), "")
    return out


def _comments(source: str) -> dict[int, str]:
    """Line number -> the comment on that line (tokenize: '#' inside strings is not one)."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and "fmt:" not in tok.string:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _described(lines: list[str], comments: dict[int, str], lineno: int) -> str:
    """The comment on line ``lineno`` (1-based), else the comment lines right above it."""
    if lineno in comments and not lines[lineno - 1].lstrip().startswith("#"):
        return comments[lineno]
    above = []
    i = lineno - 1
    while i >= 1 and lines[i - 1].lstrip().startswith("#"):
        above.insert(0, comments.get(i, ""))
        i -= 1
    return " ".join(x for x in above if x)


def config_comments() -> tuple[dict[str, str], dict[str, str], dict[str, tuple[type, str]]]:
    """From gyre/config.py: (key -> (its comment, its line), section -> its introduction, key -> (spec
    class, field) when the key's default is a spec field's)."""
    import gyre.config as config

    source = inspect.getsource(config)
    lines, comments = source.splitlines(), _comments(source)
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "default_config")
    var_class: dict[str, type] = {}
    keys, sections, fields = {}, {}, {}
    for node in ast.walk(fn):
        if not isinstance(node, ast.Assign):
            continue
        calls = (
            [node.value] if isinstance(node.value, ast.Call) else getattr(node.value, "elts", [])
        )
        names = [
            t.id for t in getattr(node.targets[0], "elts", node.targets) if isinstance(t, ast.Name)
        ]
        for name, call in zip(names, calls):
            if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "_defaults":
                var_class[name] = getattr(config, call.args[0].id)
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute)):
            continue
        key = ast.unparse(node.targets[0]).removeprefix("c.")
        text = _described(lines, comments, node.lineno)
        if isinstance(node.value, ast.Call) and "ConfigDict" in ast.unparse(node.value.func):
            sections[key] = text
            continue
        keys[key] = (text, node.lineno)
        v = node.value
        if (
            isinstance(v, ast.Attribute)
            and isinstance(v.value, ast.Name)
            and v.value.id in var_class
        ):
            fields[key] = (var_class[v.value.id], v.attr)
    return keys, sections, fields


def field_comment(cls: type, name: str) -> str:
    """The comment on the field ``name`` of the dataclass ``cls`` (its line, or just above)."""
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if f is not None and f.metadata.get("doc"):
        return f.metadata["doc"]
    source = inspect.getsource(cls)
    lines, comments = source.splitlines(), _comments(source)
    for i, line in enumerate(lines, start=1):
        if line.strip().startswith(f"{name}:"):
            return _described(lines, comments, i)
    return ""


def choices() -> dict[str, tuple]:
    """Key -> the values validate accepts, for keys with a list of choices (asked of validate
    itself: a bogus value's error names them)."""
    import re

    from gyre.config import ConfigError, default_config, validate

    try:
        validate(default_config())
    except Exception as e:  # the choices are read from validate: it must accept the defaults
        raise RuntimeError(
            f"gyre.config.validate rejects default_config() ({e!r}): the config "
            "is mid-change; generate the reference once it validates"
        ) from e
    out = {}
    for key, value in flat_defaults().items():
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            continue
        cfg = default_config()
        section, _, name = key.rpartition(".")
        target = cfg[section] if section else cfg
        target[name] = "\x00?" if isinstance(value, str) else -(10**9)
        try:
            validate(cfg)
        except (ConfigError, KeyError) as e:  # KeyError: the code is mid-change
            m = re.search(rf"'{re.escape(key)}' must be one of (.*), got", str(e))
            if m:
                out[key] = ast.literal_eval(m.group(1))
    return out


def describe() -> list[dict]:
    """One row per key: key, default, interval (or choices), meaning."""
    from gyre.config import BOUNDS

    keys, _, fields = config_comments()
    options = choices()
    rows = []
    order = {k: line for k, (_, line) in keys.items()}
    defaults = flat_defaults()
    for key in sorted(defaults, key=lambda k: (k.rpartition(".")[0] != "", order.get(k, 1e9))):
        default = defaults[key]
        meaning = DESCRIPTIONS.get(key) or keys.get(key, ("", 0))[0]
        if not meaning and key in fields:
            meaning = field_comment(*fields[key])
        if key in options:
            interval = "one of " + ", ".join(f"`{c}`" for c in options[key])
        elif key in BOUNDS:
            interval = str(BOUNDS[key])
        else:
            interval = ""
        rows.append(dict(key=key, default=default, interval=interval, meaning=meaning))
    return rows


def missing_meanings() -> list[str]:
    """Keys with no meaning from any source (what the test refuses)."""
    return [row["key"] for row in describe() if not row["meaning"].strip()]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    _, sections, _ = config_comments()
    rows = describe()
    out = [
        "# Config reference",
        "",
        "Every key a run may set (`--config.SECTION.KEY=VALUE` on the command line, or in an",
        "experiment file under `experiments/`), with its default, the interval or choices a",
        "value must lie in (checked before anything runs), and what it means. Generated from",
        "the code by `python scripts/config_doc.py` (defaults: `gyre/config.py`",
        "`default_config`, which takes a spec field's default where a key sets one; intervals:",
        "`gyre/bounds.py` and the intervals declared on spec fields; meanings: the comments in",
        "`gyre/config.py` and on the spec fields); `tests/test_config_doc.py` fails when this",
        "file is stale or a key has no meaning. Do not edit by hand.",
        "",
    ]
    current = None
    for row in rows:
        section = row["key"].rpartition(".")[0]
        if section != current:
            current = section
            out += ["", f"## `{section}`" if section else "## top level", ""]
            if sections.get(section):
                out += [sections[section], ""]
            out += ["| key | default | interval | meaning |", "|---|---|---|---|"]
        default = repr(row["default"]) if isinstance(row["default"], str) else row["default"]
        out.append(f"| `{row['key']}` | `{_cell(str(default))}` | {_cell(row['interval'])} "
                   f"| {_cell(row['meaning'])} |")  # fmt: skip
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    missing = missing_meanings()
    if missing:
        print(
            f"keys without a meaning (comment them in gyre/config.py or on their spec field, "
            f"or add them to DESCRIPTIONS in {__file__}): {missing}",
            file=sys.stderr,
        )
    if "--check" in argv:
        stale = not DOC.exists() or DOC.read_text() != text
        if stale:
            print(f"{DOC} is stale: run python scripts/config_doc.py", file=sys.stderr)
        return int(stale)
    DOC.write_text(text)
    print(f"wrote {DOC} ({len(describe())} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
