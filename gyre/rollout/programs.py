"""The jit programs of a rollout cell: batched chunked prefill, decode loops, KV row moves.

Shapes are fixed: a prefill call takes one ``prefill_chunk`` for each of up to ``slots`` slots
and runs the given number of rows in a loop on the device; a decode loop runs up to
:func:`loop_steps` tokens for every slot inside one jitted ``while_loop`` (finished and idle
slots write nowhere) and returns all new tokens in one transfer. So the number of live
requests never changes a shape: each program compiles once per cell, and every engine built
for the same (cell, config) shares them (:func:`programs_for`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from gyre import bounds
from gyre import mesh as gmesh
from gyre.model import attention
from gyre.model import decoder as gdec
from gyre.rollout import sampler
from gyre.rollout.types import ADMISSIONS, CPU_VECTOR_WIDTHS


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """What a rollout cell's programs and engine depend on (frozen: it keys the jit cache)."""

    model: gdec.ModelSpec
    slots: int = 16  # KV slots per cell (concurrent requests)
    max_len: int = 512  # tokens per slot
    prefill_chunk: int = 64
    # Decode tokens per device loop: one dispatch and one host transfer per loop; 1 = a
    # program of one step per dispatch (the reference path the loop must equal bit for bit);
    # -1 = auto (:func:`loop_steps`).
    decode_steps: int = -1
    temperature: float = 1.0  # default for requests that set none
    top_p: float = 1.0
    seed: int = 0  # sampler base key
    # KV pool budget per cell in tokens (gyre/rollout/engine.py); 0 = derived: slots * max_len
    # on CPU, device memory minus weights minus a reserve where the platform reports memory.
    # Not a shape: the programs ignore it (programs_for drops it from the jit cache key).
    kv_tokens: int = 0
    # How the proxy admits calls (gyre/rollout/proxy.py): 'none' = each call on its own (a
    # call goes where a slot and pool room are free; idle contexts are evicted LRU);
    # 'resident' = an execution is admitted to one cell with a KV reservation that grows with
    # its context (gyre/elastic/admission.py), so its context stays resident between calls;
    # calls of admitted executions go first. Host-side: no program reads it.
    admission: str = "none"
    # SIMD width XLA:CPU's emitted code prefers in these programs (:func:`compiler_options`):
    # -1 auto, 0 XLA's default, else 128/256/512 bits. Accelerators ignore it.
    cpu_vector_width: int = -1
    # Attention reads the KV cache in blocks of this many entries up to the live context
    # (:func:`kv_blocks`): -1 auto, 0 dense over all max_len entries.
    kv_block: int = -1
    # The KV cache's memory (gyre/rollout/engine.py): 0 = slots x max_len (each slot one
    # contiguous row, as before paging); N > 0 = a pool of pages of N tokens that slots hold
    # through page tables (gyre/kvpool.py): the pool's size is kv_tokens (or device
    # memory), not slots x max_len, prompts are shared by reference, and attention reads each
    # slot's live pages, several pages a block (:func:`paged_kv_block`: kv_block, auto 128, in
    # whole pages), bit for bit the slot layout's live blocks. max_len must be a multiple of N.
    kv_page: int = bounds.knob(0, bounds.Bound(0))

    def __post_init__(self):
        bounds.check(self, "rollout")
        if self.kv_page and self.max_len % self.kv_page:
            raise ValueError(
                f"rollout.max_len ({self.max_len}) must be a multiple of rollout.kv_page "
                f"({self.kv_page})"
            )
        if self.decode_steps == 0:
            raise ValueError(
                f"rollout.decode_steps must be -1 (auto) or >= 1, got {self.decode_steps}"
            )
        if self.admission not in ADMISSIONS:
            raise ValueError(
                f"rollout.admission must be one of {ADMISSIONS}, got {self.admission!r}"
            )
        if self.cpu_vector_width not in CPU_VECTOR_WIDTHS:
            raise ValueError(
                f"rollout.cpu_vector_width must be one of {CPU_VECTOR_WIDTHS}, "
                f"got {self.cpu_vector_width}"
            )


def compiler_options(r: RolloutSpec, platform: str) -> dict:
    """XLA options of the prefill and decode programs of a cell on ``platform``.

    On CPU, ``r.cpu_vector_width`` sets the SIMD width XLA prefers in the code it emits
    (fusions, and the dots of a one-row batch, which XLA emits as matrix-vector loops of its
    own; from two rows on, dots run in library kernels the option does not reach). Auto (-1)
    asks for 512 bits when the cell has one slot: the batch-1 decode loop is those
    matrix-vector products, which run 1.2-1.5x faster with 512-bit vectors on an AVX-512 host
    (benchmarks/vs_tunix.py, BENCHMARKS.md; only an AVX-512 host was measured). Other
    platforms get no options."""
    width = r.cpu_vector_width
    if width == -1:
        width = 512 if r.slots == 1 else 0
    if platform != "cpu" or width == 0:
        return {}
    return {"xla_cpu_prefer_vector_width": width}


# Auto kv_block: blocks of this many entries; decode reads live blocks once max_len is at
# least LIVE_DECODE_FROM of them.
AUTO_KV_BLOCK, LIVE_DECODE_FROM = 128, 8


# Auto decode loop lengths (rollout.decode_steps -1): see loop_steps.
AUTO_DECODE_STEPS = 16
ONE_SLOT_DECODE_STEPS = 64


def loop_steps(r: RolloutSpec) -> int:
    """Decode tokens per device loop (one dispatch, one host transfer) of a cell of ``r``.

    A loop ends early when no slot runs, or, with requests waiting for a slot, as soon as
    one slot frees; otherwise a slot that finishes mid-loop sits idle until the loop ends,
    and its result waits with it. Auto (-1): 16 for a cell of several slots (in the quick
    start 16 gave a 5.6% idle share and ran 13% faster than 4, and 32 or 64 were no faster;
    BENCHMARKS.md), 64 for a one-slot cell, where no slot can sit idle (its loop ends when its
    one request does) and a loop's fixed cost, ~0.45 ms a dispatch on CPU, is a whole
    token's time at batch 1: a 128-token call ran 6-13% faster than with 16 (the vs_tunix
    model, prompts 64 and 512). N >= 1: N for every cell."""
    if r.decode_steps != -1:
        return r.decode_steps
    return ONE_SLOT_DECODE_STEPS if r.slots == 1 else AUTO_DECODE_STEPS


def kv_blocks(r: RolloutSpec) -> tuple[int, int]:
    """(prefill, decode) block sizes of the programs' attention; 0 = dense over max_len.

    Dense attention reads all max_len entries of a slot; live blocks read only up to the
    live context, in a device loop over the blocks. Prefill runs one row at a time, so its
    blocks stop at the row's own length; decode runs every slot together, so its blocks stop
    at the longest running context. On CPU (benchmarks/live_attention.py, BENCHMARKS.md)
    live prefill took 0.4-0.9x the time of dense at every max_len measured (192-2048), so
    auto (-1) always prefills by live blocks of 128. Live decode with contexts of 64-192
    tokens ran 1.7-4.0x faster than dense at max_len 2048 and 1.1-1.6x at 512, but 0.8-1.0x
    at 192 (two blocks) and 0.65-1.2x when contexts fill a 1024 cache; the quick start
    (max_len 512, agent contexts filling much of it) ran 20% slower end to end with live
    decode. So auto decodes by live blocks from max_len >= 8 blocks (1024), where dense
    attention's cost grows fastest, and densely below; a cell at max_len 512 whose contexts
    stay short gains by setting 128. 0: dense everywhere; N: live blocks of N everywhere. A
    static choice per cell: rows never depend on the other rows (every path is
    batch-invariant bit for bit; dense and live differ in the last bits)."""
    if r.kv_block != -1:
        return r.kv_block, r.kv_block
    live_decode = r.max_len >= LIVE_DECODE_FROM * AUTO_KV_BLOCK
    return AUTO_KV_BLOCK, AUTO_KV_BLOCK if live_decode else 0


def paged_kv_block(r: RolloutSpec) -> int:
    """Entries a paged cache's attention reads a block, prefill and decode: ``r.kv_block``
    where > 0, else (auto, or 0: a paged cache has no dense path) ``AUTO_KV_BLOCK``, at most
    ``max_len``, in whole pages (at least one; :func:`attention.pages_per_block`). A block of
    several pages is gathered into a slot block's layout, so paged rows equal, bit for bit,
    the slot layout's rows read in live blocks of the same size, whatever the page size (and
    so do two page sizes with the same block)."""
    block = min(r.kv_block if r.kv_block > 0 else AUTO_KV_BLOCK, r.max_len)
    return attention.pages_per_block(r.kv_page, block) * r.kv_page if r.kv_page else block


# Stop ids a request may give (the decode loop checks them on the device, padded with -1).
MAX_STOP_TOKENS = 8


def forward_paged(spec: gdec.ModelSpec, weights: dict, tokens_BxT, pos_BxT, cache, table_BxP,
                  start_B, block: int = AUTO_KV_BLOCK):  # fmt: skip
    """:func:`gyre.model.decoder.forward_serving` over a paged cache: row b's tokens are
    written to and read from the pages ``table_BxP[b]`` names (token i in page i // ps at
    offset i % ps; entries past a row's pages hold the page count, so writes there are
    dropped). ``cache``: {'k': L x [N, KVH, Dh, ps], 'v': L x [N, KVH, ps, Dh]} (the slot
    cache's layouts with pages for slots). Decode (T = 1, a row per slot) and one prefill row
    (B = 1) attend over the row's live pages (:func:`attention.paged_decode_attention`,
    :func:`attention.paged_prefill_attention`); rows at start >= max_len write nowhere.
    -> (hidden [B,T,D], new cache)."""
    dtype = jnp.dtype(spec.dtype)
    b, t = tokens_BxT.shape
    ks, vs = list(cache["k"]), list(cache["v"])
    n_pages, ps = vs[0].shape[0], vs[0].shape[2]
    pages = table_BxP.shape[1]
    idx_BxT = start_B[:, None] + jnp.arange(t, dtype=start_B.dtype)[None, :]
    entry_BxT = jnp.take_along_axis(table_BxP, jnp.minimum(idx_BxT // ps, pages - 1), axis=1)
    page_BxT = jnp.where(idx_BxT < pages * ps, entry_BxT, n_pages)  # n_pages: dropped
    off_BxT = idx_BxT % ps
    live = attention.live_length(start_B, pages * ps) if t == 1 else None
    x = weights["embed"].astype(dtype)[tokens_BxT]
    for i, p in enumerate(weights["layers"]):
        q, k, v = gdec._qkv(p, x, pos_BxT, spec, dtype)
        # K page [KVH, Dh, ps] at (page, :, :, off), V page [KVH, ps, Dh] at (page, :, off):
        # both indexed views are [B, T, KVH, Dh]
        ks[i] = ks[i].at[page_BxT, :, :, off_BxT].set(k.astype(ks[i].dtype), mode="drop")
        vs[i] = vs[i].at[page_BxT, :, off_BxT].set(v.astype(vs[i].dtype), mode="drop")
        if t == 1:
            k_own, v_own = (a.astype(ks[i].dtype).astype(dtype) for a in (k, v))  # as stored
            out = attention.paged_decode_attention(
                q, k_own, v_own, ks[i], vs[i], table_BxP, start_B, block, live
            )
        else:
            if b != 1:
                raise ValueError(f"a paged prefill runs one row at a time, got {b}")
            out = attention.paged_prefill_attention(
                q, ks[i], vs[i], table_BxP[0], idx_BxT, start_B + t, block
            )
        x = gdec._finish_block(p, x, out, spec, dtype)
    x = gdec.rms_norm(x, weights["final_norm"], spec.rms_eps)
    return x, {"k": tuple(ks), "v": tuple(vs)}


class Programs:
    """The jit programs of one cell (one compile per cell; every shape is fixed).

    ``num_pages`` > 0 (``r.kv_page`` > 0): the cache is a page pool, {'k': L x [N, KVH, Dh,
    ps], 'v': L x [N, KVH, ps, Dh]} (pages over the cell's 'data' axis like slots, kv heads
    over 'model'), and prefill and decode take the slots' page tables, int32[S, max_len / ps],
    as their last argument (a table is data: changing it compiles nothing)."""

    def __init__(self, r: RolloutSpec, cell: gmesh.Cell, num_pages: int = 0):
        spec = r.model
        self.graphdef, abstract_state = gdec.abstract_model(spec)
        s, m, c = r.slots, r.max_len, r.prefill_chunk
        n_layers = spec.num_layers
        self.paged = paged = num_pages > 0
        if paged and not r.kv_page:
            raise ValueError("a paged cache needs rollout.kv_page > 0")
        self.num_pages, self.page_size = num_pages, r.kv_page if paged else m
        self.table_pages = m // r.kv_page if paged else 1
        # {'k','v'}: a layer's cache shape (pages of ps tokens for slots of max_len when paged)
        shapes = (gdec.cache_shapes(num_pages, spec.num_kv_heads, r.kv_page, spec.head_dim)
                  if paged else gdec.cache_shapes(s, spec.num_kv_heads, m, spec.head_dim))  # fmt: skip
        abstract_cache = {
            k: (jax.ShapeDtypeStruct(shapes[k], spec.dtype),) * n_layers for k in "kv"
        }
        self.state_sh = gdec.state_shardings(spec, cell, "rollout")
        abstract_weights = jax.eval_shape(
            lambda st: gdec.serving_weights(self.graphdef, st), abstract_state
        )
        self.weights_sh = gmesh.tree_shardings(
            cell, "rollout", gdec.serving_logical_axes(spec), abstract_weights
        )
        self.cache_sh = gmesh.tree_shardings(
            cell, "rollout", gdec.cache_logical_axes(n_layers), abstract_cache
        )
        # one page's (or slot's) bytes on the cell, K and V of every layer
        self.page_bytes = 2 * sum(
            math.prod(a.shape[1:]) * jnp.dtype(a.dtype).itemsize for a in abstract_cache["v"]
        )
        # one slot's rows: the cache's layout with the slot axis kept whole (None)
        self.rows_sh = {
            k: (gmesh.sharding_for(cell, "rollout", (None, *gdec.CACHE_AXES[k][1:])),) * n_layers
            for k in "kv"
        }
        rep = NamedSharding(cell.mesh, PartitionSpec())
        vec = gmesh.sharding_for(cell, "rollout", ("batch",), (s,), "rollout.slots")
        base = sampler.base_key(r.seed)
        max_len = m
        top_p = float(r.top_p)
        prefill_block, decode_block = kv_blocks(r)  # 0: dense attention over max_len
        paged_block = paged_kv_block(r)

        def forward(weights, tokens_BxT, pos_BxT, cache, slot_B, start_B, block, tab):
            """The serving forward; ``tab``: () for slots, (page tables int32[S, P],) paged."""
            if not paged:
                return gdec.forward_serving(
                    spec, weights, tokens_BxT, pos_BxT, cache, slot_B, start_B, block
                )
            table = tab[0] if slot_B is None else tab[0][slot_B]
            return forward_paged(spec, weights, tokens_BxT, pos_BxT, cache, table, start_B,
                                 paged_block)  # fmt: skip

        def prefill_row(weights, cache, tokens_1xC, start_1, slot_1, last_1, hash_1, call_1,
                        temp_1, *tab):  # fmt: skip
            pos_1xC = start_1[:, None] + jnp.arange(c, dtype=jnp.int32)[None, :]
            hidden, cache = forward(
                weights, tokens_1xC, pos_1xC, cache, slot_1, start_1, prefill_block, tab
            )
            h_1x1xD = jnp.take_along_axis(hidden, last_1[:, None, None], axis=1)
            logits_1xV = gdec.serving_logits(spec, weights, h_1x1xD)[:, 0]
            keys = sampler.token_keys(base, hash_1, call_1, start_1 + last_1 + 1)
            return (cache, *sampler.sample(logits_1xV, keys, temp_1, top_p))

        def prefill(weights, cache, tokens_SxC, start_S, slot_S, last_S, hash_S, call_S, temp_S,
                    rows, *tab):  # fmt: skip
            """One chunk for each of the first ``rows`` rows (a slot each), in one dispatch.

            Rows run one after another at the shape of one (a loop on the device), so a
            row's numbers never depend on which rows share its call, and rows past ``rows``
            cost nothing. -> (cache, token int32[S], logprob float32[S]): each row's token
            sampled after index last_S (used when the chunk ends the prompt)."""

            def body(carry):
                i, cache, tok_S, lp_S = carry
                row = lambda x: jax.lax.dynamic_slice_in_dim(x, i, 1)  # noqa: E731
                cache, tok_1, lp_1 = prefill_row(
                    weights, cache, row(tokens_SxC), row(start_S), row(slot_S), row(last_S),
                    row(hash_S), row(call_S), row(temp_S), *tab,
                )  # fmt: skip
                tok_S = jax.lax.dynamic_update_slice_in_dim(tok_S, tok_1, i, 0)
                lp_S = jax.lax.dynamic_update_slice_in_dim(lp_S, lp_1, i, 0)
                return i + 1, cache, tok_S, lp_S

            init = (jnp.int32(0), cache, jnp.zeros(s, jnp.int32), jnp.zeros(s, jnp.float32))
            _, cache, tok_S, lp_S = jax.lax.while_loop(lambda c: c[0] < rows, body, init)
            return cache, tok_S, lp_S

        def decode_step(weights, cache, tokens_S, start_S, hash_S, call_S, temp_S, *tab):
            """One token for every slot; rows with start >= max_len write nowhere."""
            hidden, cache = forward(
                weights, tokens_S[:, None], start_S[:, None], cache, None, start_S, decode_block,
                tab,
            )  # fmt: skip
            logits_SxV = gdec.serving_logits(spec, weights, hidden)[:, 0]
            keys = sampler.token_keys(base, hash_S, call_S, start_S + 1)
            return (cache, *sampler.sample(logits_SxV, keys, temp_S, top_p))

        n = loop_steps(r)

        def decode_loop(weights, cache, tokens_S, start_S, left_S, stop_SxK, hash_S, call_S,
                        temp_S, exit_on_free, *tab):  # fmt: skip
            """Up to ``n`` decode steps on the device. A slot runs while ``left_S`` > 0 (its
            token budget; 0 = idle) and stops after sampling one of its stop ids. The loop
            ends after n steps, when no slot runs, or (``exit_on_free``: requests wait for a
            slot) as soon as one slot has finished. -> (cache, tokens int32[n, S] (-1 where
            the slot did not run), logprobs float32[n, S], steps run)."""

            def cond(carry):
                i, _, _, _, left_S, _, _ = carry
                running_S = left_S > 0
                freed = jnp.any(~running_S & (left0_S > 0))
                return (i < n) & jnp.any(running_S) & ~(exit_on_free & freed)

            def body(carry):
                i, cache, tok_S, pos_S, left_S, out_tok, out_lp = carry
                run_S = left_S > 0
                write_S = jnp.where(run_S, pos_S, max_len)  # idle rows write past the cache
                cache, new_S, lp_S = decode_step(
                    weights, cache, tok_S, write_S, hash_S, call_S, temp_S, *tab
                )
                stopped_S = jnp.any(new_S[:, None] == stop_SxK, axis=1)
                out_tok = out_tok.at[i].set(jnp.where(run_S, new_S, -1))
                out_lp = out_lp.at[i].set(jnp.where(run_S, lp_S, 0.0))
                tok_S = jnp.where(run_S, new_S, tok_S)
                pos_S = pos_S + run_S.astype(pos_S.dtype)
                left_S = jnp.where(stopped_S, 0, jnp.maximum(left_S - 1, 0))
                return i + 1, cache, tok_S, pos_S, left_S, out_tok, out_lp

            left0_S = left_S
            init = (jnp.int32(0), cache, tokens_S, start_S, left_S,
                    jnp.full((n, s), -1, jnp.int32), jnp.zeros((n, s), jnp.float32))  # fmt: skip
            steps, cache, _, _, _, out_tok, out_lp = jax.lax.while_loop(cond, body, init)
            return cache, out_tok, out_lp, steps

        def copy_slot(cache, src, dst):
            """Slot ``dst`` becomes a copy of slot ``src`` (the caller keeps a prefix of it)."""
            copy = lambda x: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
                x, jax.lax.dynamic_slice_in_dim(x, src, 1, axis=0), dst, axis=0
            )
            return jax.tree.map(copy, cache)

        def read_rows(cache, slot):
            """One slot's K/V: {'k': L arrays [1, KVH, Dh, M], 'v': L arrays [1, KVH, M, Dh]}."""
            return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0), cache)

        def write_rows(cache, rows, slot):
            write = lambda x, r: jax.lax.dynamic_update_slice_in_dim(  # noqa: E731
                x, r.astype(x.dtype), slot, axis=0
            )
            return jax.tree.map(write, cache, rows)

        def read_pages(cache, pages_N):
            """Pages ``pages_N`` of the pool: {'k': L x [N, KVH, Dh, ps], 'v': L x [N, ...]}."""
            return jax.tree.map(lambda x: x[pages_N], cache)

        def write_pages(cache, rows, pages_N):
            return jax.tree.map(lambda x, r: x.at[pages_N].set(r.astype(x.dtype)), cache, rows)

        out = (self.cache_sh, rep, rep)
        self.compiler_options = opts = compiler_options(r, cell.devices[0].platform)
        self.prefill = jax.jit(prefill, donate_argnums=1, out_shardings=out,
                               compiler_options=opts)  # fmt: skip
        tab_sh = ()
        if paged:
            tab_sh = (gmesh.sharding_for(cell, "rollout", ("batch", None),
                                         (s, self.table_pages), "rollout.slots"),)  # fmt: skip
        self.decode = jax.jit(
            decode_step,
            donate_argnums=1,
            compiler_options=opts,
            in_shardings=(self.weights_sh, self.cache_sh, vec, vec, vec, vec, vec, *tab_sh),
            out_shardings=(self.cache_sh, vec, vec),
        )
        mat = gmesh.sharding_for(cell, "rollout", (None, "batch"), (n, s), "rollout.slots")
        stop_sh = gmesh.sharding_for(cell, "rollout", ("batch", None), (s, MAX_STOP_TOKENS),
                                     "rollout.slots")  # fmt: skip
        self.decode_loop = jax.jit(
            decode_loop,
            donate_argnums=1,
            compiler_options=opts,
            in_shardings=(
                self.weights_sh,
                self.cache_sh,
                vec,
                vec,
                vec,
                stop_sh,
                vec,
                vec,
                vec,
                rep,
                *tab_sh,
            ),
            out_shardings=(self.cache_sh, mat, mat, rep),
        )
        # The stacked parameter state (in its rollout layout) -> the weights the programs read.
        self.serving_weights = jax.jit(
            functools.partial(gdec.serving_weights, self.graphdef),
            in_shardings=(self.state_sh,), out_shardings=self.weights_sh,
        )  # fmt: skip
        self.copy_slot = jax.jit(copy_slot, donate_argnums=0, out_shardings=self.cache_sh)
        self.copy_page = self.copy_slot  # paged: one page of the pool into another
        self.read_rows = jax.jit(read_rows, out_shardings=self.rows_sh)
        self.write_rows = jax.jit(write_rows, donate_argnums=0, out_shardings=self.cache_sh)
        # Paged: a hand-over's pages (one compile per page count moved: hand-overs are rare).
        self.read_pages = jax.jit(read_pages, out_shardings=self.rows_sh)
        self.write_pages = jax.jit(write_pages, donate_argnums=0, out_shardings=self.cache_sh)
        zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_cache)
        self.new_cache = jax.jit(zeros, out_shardings=self.cache_sh)


def programs_for(spec: RolloutSpec, cell: gmesh.Cell, num_pages: int = 0) -> Programs:
    """Programs of ``cell`` for ``spec`` (and, paged, a pool of ``num_pages`` pages: a shape),
    shared by every engine built for the same pair.

    Engines that differ only in their KV budget (``kv_tokens``, host-side accounting; paged,
    through ``num_pages``) share them.
    """
    return _programs_for(dataclasses.replace(spec, kv_tokens=0), cell, num_pages)


@functools.lru_cache(maxsize=64)
def _programs_for(spec: RolloutSpec, cell: gmesh.Cell, num_pages: int) -> Programs:
    return Programs(spec, cell, num_pages)
