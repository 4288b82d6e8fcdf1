"""Reference implementations the tests compare the production code against.

Each is the slow, obvious version of something the code does fast or implicitly: a dense
visibility mask for the tree layout, the numpy PPO objective, the root-to-leaf sequences of a
demonstration, a per-token trie under the tree's merge rule, flat per-path rows built
from the records themselves, the sampler's logprob convention on the host, and a transformers
Qwen3 model.
"""

from __future__ import annotations

import numpy as np

from gyre.trajectory.pack import PackedBatch
from gyre.trajectory.tree import SAME_LOGP_TOL


def ancestors_from_leave(leave_T: np.ndarray) -> np.ndarray:
    """bool[T, T]: sees[q, k] = k <= q < leave[k] (k is q or an ancestor of q)."""
    t = leave_T.shape[-1]
    q, k = np.arange(t)[:, None], np.arange(t)[None, :]
    return (k <= q) & (q < leave_T[None, :])


def clipped_objective(
    batch: PackedBatch, logp_RxT: np.ndarray, clip_low: float, clip_high: float
) -> float:
    """Numpy reference of the sign-split PPO loss -sum_j [min(r, clip r) adv_pos + max(r, clip r) adv_neg]."""
    r = np.exp(logp_RxT.astype(np.float64) - batch.old_logp)
    rc = np.clip(r, 1 - clip_low, 1 + clip_high)
    return float(-np.sum(np.minimum(r, rc) * batch.adv_pos + np.maximum(r, rc) * batch.adv_neg))


def demo_sequences(demo) -> list[tuple[np.ndarray, np.ndarray]]:
    """Root-to-leaf sequences: (tokens int32[T], loss mask float32[T]) per leaf record.

    A record is a leaf when no later record's prompt starts with its tokens. The mask is the
    record loss mask at the completion positions of every record on the leaf's path.
    """
    recs = demo.records
    full = [r.tokens for r in recs]

    def extends(long, short):
        return long.size >= short.size and np.array_equal(long[: short.size], short)

    out = []
    for j in range(len(recs)):
        if any(extends(recs[k].prompt, full[j]) for k in range(j + 1, len(recs))):
            continue
        mask = np.zeros(full[j].size, np.float32)
        for k in range(j + 1):
            if extends(full[j], full[k]):
                p = recs[k].prompt.size
                mask[p : p + recs[k].completion.size] = demo.loss_masks[k]
        out.append((full[j].astype(np.int32), mask))
    return out


def token_trie(records) -> tuple[list[list], list[list[int]]]:
    """Per-token trie under the tree's merge rule (see gyre.trajectory.tree), one dict entry
    per token. Returns nodes [parent, token, generating call (-1: context), completion
    offset] in creation order, and each call's root-to-end node ids.

    A prompt follows its guide's nodes (the parent's, else the previous call's) while their
    tokens agree, then the deepest chain of existing nodes that spells it (the oldest on
    ties); a completion token joins the oldest same-token child that is context (claiming
    it) or was generated with the same version and an isclose logprob, else a new node.
    """
    nodes, kids, paths = [], {}, []
    index = {rec.call_id: i for i, rec in enumerate(records)}
    seqs = [rec.tokens.tolist() for rec in records]

    def deepest(seq, p, node, j):  # longest chain below node spelling seq[j:p], oldest first
        best = []
        for n in kids.get((node, seq[j]), []) if j < p else []:
            chain = [n] + deepest(seq, p, n, j + 1)
            best = chain if len(chain) > len(best) else best
        return best

    def same(n, rec, j):
        g, o = nodes[n][2:]
        if g < 0:
            return True
        a, b = float(rec.logprobs[j]), float(records[g].logprobs[o])
        close = abs(a - b) <= SAME_LOGP_TOL * (1 + abs(b))
        return close and rec.versions[j] == records[g].versions[o]

    for i, rec in enumerate(records):
        seq, p = seqs[i], rec.prompt.size
        guide = index.get(rec.parent_id, i - 1)
        guide = i - 1 if guide >= i else guide
        path = []
        if guide >= 0:
            other = seqs[guide]
            while len(path) < min(p, len(other)) and seq[len(path)] == other[len(path)]:
                path.append(paths[guide][len(path)])
        path += deepest(seq, p, path[-1] if path else -1, len(path))
        for j in range(len(path), len(seq)):
            node = path[-1] if path else -1
            cands = kids.get((node, seq[j]), []) if j >= p else []
            pick = next((n for n in cands if same(n, rec, j - p)), None)
            if pick is None:
                pick = len(nodes)
                nodes.append([node, seq[j], i if j >= p else -1, j - p])
                kids.setdefault((node, seq[j]), []).append(pick)
            elif nodes[pick][2] < 0:
                nodes[pick][2:] = [i, j - p]
            path.append(pick)
        paths.append(path)
    return nodes, paths


def path_behaviour(records) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per call, from the records: (trainable bool[L], logp float32[L], version int32[L]) of
    its root-to-end tokens. Its completion carries its own record's values; a prompt token is
    trainable with the values of the call that generated it there (as :func:`token_trie`
    attributes it), read from that call's record."""
    nodes, paths = token_trie(records)
    out = []
    for rec, path in zip(records, paths):
        src = [nodes[n][2:] for n in path]
        trainable = np.asarray([g >= 0 for g, _ in src])
        logp = np.asarray([records[g].logprobs[o] if g >= 0 else 0 for g, o in src], np.float32)
        version = np.asarray([records[g].versions[o] if g >= 0 else -1 for g, o in src], np.int32)
        p = rec.prompt.size
        trainable[p:], logp[p:], version[p:] = True, rec.logprobs, rec.versions
        out.append((trainable, logp, version))
    return out


def flat_rows(executions, kept, coefs, advantages, row_len: int) -> dict:
    """Training rows with one causal segment per kept path, built from the records alone.

    executions[e]: call records; kept[e]: call indices whose root-to-end paths are trained;
    coefs[e]: their c_p; advantages[e]: A. Paths are placed first-fit, in order.
    """
    segments = []  # (row, offset, tokens, trainable, logp, version, c, A)
    used = []
    for recs, calls, cs, a in zip(executions, kept, coefs, advantages):
        behaviour = path_behaviour(recs)
        for call, c in zip(calls, cs):
            n = recs[call].tokens.size
            r = next((r for r, u in enumerate(used) if u + n <= row_len), len(used))
            used += [0] if r == len(used) else []
            segments.append((r, used[r], recs[call].tokens, *behaviour[call], c, a))
            used[r] += n
    shape = (len(used), row_len)
    out = {k: np.zeros(shape, np.float32) for k in ("old_logp", "adv_pos", "adv_neg", "w")}
    out.update(
        tokens=np.zeros(shape, np.int32),
        pos=np.zeros(shape, np.int32),
        leave=np.tile(np.arange(1, row_len + 1, dtype=np.int32), (len(used), 1)),
        pred=np.full(shape, -1, np.int32),
        versions=np.full(shape, -1, np.int32),
    )
    for r, o, tokens, trainable, logp, version, c, a in segments:
        n = tokens.size
        cols, w = slice(o, o + n), c * trainable
        out["tokens"][r, cols], out["pos"][r, cols] = tokens, np.arange(n)
        out["leave"][r, cols], out["pred"][r, cols] = o + n, np.arange(o - 1, o + n - 1)
        out["pred"][r, o] = -1
        out["old_logp"][r, cols], out["versions"][r, cols] = logp, version
        out["w"][r, cols] = w
        out["adv_pos"][r, cols], out["adv_neg"][r, cols] = w * max(a, 0), w * min(a, 0)
    return out


def token_logprobs(logits_NxV, tokens_N, temperature: float) -> np.ndarray:
    """float32[N] log-probabilities of ``tokens_N`` under the sampler's convention with
    top_p = 1: ``log_softmax(logits / temperature)``, temperature 1 when greedy (0)."""
    logits = np.asarray(logits_NxV, np.float64)
    if temperature > 0:
        logits = logits / temperature
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return logp[np.arange(len(tokens_N)), np.asarray(tokens_N)].astype(np.float32)


def qwen3_torch_model(vocab_size: int, tie: bool, seed: int = 0):
    """A tiny random transformers Qwen3ForCausalLM (the loaders' reference); every weight
    perturbed so no mapping hides behind 0/1. Imports torch and transformers (dev deps)."""
    import torch
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=tie,
        rope_theta=5000.0, rms_norm_eps=1e-5,
    )  # fmt: skip
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn_like(p))
    return model
