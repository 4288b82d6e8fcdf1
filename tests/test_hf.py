"""HF Qwen3 parity: load a random transformers checkpoint, compare logits (causal and tree)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from oracles import qwen3_torch_model  # noqa: E402

from gyre.config import default_config  # noqa: E402
from gyre.mesh import make_cells  # noqa: E402
from gyre.model import ModelSpec, apply, apply_logits  # noqa: E402
from gyre.model.hf import config_from_hf, load_hf, save_hf  # noqa: E402
from gyre.rl.builder import build_specs  # noqa: E402

T = 16


def gyre_cfg() -> ModelSpec:
    # the reference path; test_model compares block_sparse against it
    return dataclasses.replace(build_specs(default_config()).model, attention="dense")


def torch_model(tie: bool, seed: int = 0):
    return qwen3_torch_model(128, tie, seed)


def random_tree(seed: int, t: int):
    """DFS-ordered branchy tree: (tokens, pos, leave), each int numpy [t]."""
    rng = np.random.default_rng(seed)
    pos, leave, stack = np.zeros(t, np.int64), np.full(t, t, np.int64), []
    for i in range(t):
        if stack and rng.random() < 0.35:
            for _ in range(rng.integers(1, len(stack) + 1)):
                leave[stack.pop()] = i
        pos[i] = len(stack)
        stack.append(i)
    return rng.integers(0, 128, t), pos, leave


def torch_logits(model, tokens, pos, visible=None):
    """Logits [B,T,V]; ``visible`` bool [B,T,T] becomes an additive 4-D mask."""
    kwargs = {"position_ids": torch.tensor(np.array(pos))}
    if visible is not None:
        additive = np.where(visible, 0.0, np.finfo(np.float32).min).astype(np.float32)
        kwargs["attention_mask"] = torch.as_tensor(additive[:, None])
    with torch.no_grad():
        return model(torch.tensor(np.array(tokens)), **kwargs).logits.numpy()


def gyre_logits(graphdef, state, tokens, pos, leave):
    hidden = apply(graphdef, state, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(leave))
    return np.asarray(apply_logits(graphdef, state, hidden))


@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_transformers_causal_and_tree(tmp_path, tie):
    model = torch_model(tie)
    # the tied case goes through a sharded checkpoint with an index file
    model.save_pretrained(tmp_path, max_shard_size="50KB" if tie else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == tie
    graphdef, state, cfg = load_hf(str(tmp_path), gyre_cfg())
    assert (cfg.d_model, cfg.num_layers, cfg.head_dim, cfg.tie_embeddings) == (64, 2, 16, tie)
    assert cfg.rope_theta == 5000.0 and cfg.rms_eps == 1e-5

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128, (2, T))
    pos = np.broadcast_to(np.arange(T), (2, T))
    want = torch_logits(model, tokens, pos)
    got = gyre_logits(graphdef, state, tokens, pos, np.full((2, T), T))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)

    rows = [random_tree(seed, T) for seed in (1, 2)]
    tokens, pos, leave = (np.stack([r[i] for r in rows]) for i in range(3))
    assert (pos.max(1) < T - 1).all()  # really branchy, not a chain
    q, k = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (k <= q) & (q < leave[:, None, :])
    want = torch_logits(model, tokens, pos, visible)
    got = gyre_logits(graphdef, state, tokens, pos, leave)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_save_hf_round_trips_through_transformers(tmp_path):
    model = torch_model(tie=False, seed=1)
    model.save_pretrained(tmp_path / "src")
    cell = make_cells(2)[0]
    graphdef, state, cfg = load_hf(str(tmp_path / "src"), gyre_cfg(), cell=cell, role="train")
    assert state["layers"]["q"].sharding.spec[1] == "data"  # placed per the train RULES
    save_hf(str(tmp_path / "out"), graphdef, state, cfg)
    back = transformers.Qwen3ForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    tokens = np.random.default_rng(3).integers(0, 128, (1, T))
    pos = np.arange(T)[None]
    np.testing.assert_allclose(
        torch_logits(back, tokens, pos), torch_logits(model, tokens, pos), atol=1e-5, rtol=1e-5
    )
    graphdef2, state2, _ = load_hf(str(tmp_path / "out"), gyre_cfg())
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), jax.device_get(state2))


def test_bfloat16_checkpoint_loads(tmp_path):
    model = torch_model(tie=True, seed=2).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    _, state, _ = load_hf(str(tmp_path), gyre_cfg())
    want = model.model.layers[1].self_attn.o_proj.weight.detach().float().numpy()  # [D, H*Dh]
    got = np.asarray(state["layers"]["o"][1]).reshape(-1, 64).T
    np.testing.assert_array_equal(got, want)
    assert state["embed"].dtype == jnp.float32


def test_unsupported_config_is_a_clear_error():
    hf = json.loads(json.dumps(dict(model_type="qwen3", attention_bias=True)))
    with pytest.raises(ValueError, match="attention_bias"):
        config_from_hf(hf, gyre_cfg())
    with pytest.raises(ValueError, match="model_type"):
        config_from_hf({"model_type": "llama"}, gyre_cfg())
