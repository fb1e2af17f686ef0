"""Paged attention as XLA ops: pages read in chunks with an online softmax (the CPU path).

Each step of the loop gathers `pages_per_chunk` pages of every group (one [Q, chunk]
gather of the block tables, then of the pages) and folds them into a running max, sum
and weighted values, so memory holds [C, chunk] scores per head, not the whole sequence.
The loop runs only over the chunks the furthest query reaches, so a step reads no
further than its longest sequence; a shorter group's table points past its end at the
null page (page 0), whose keys are masked.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kernels.paged_attention.ref import key_mask
from kernels.paged_attention.validate import static_validate_inputs

MASK_VALUE = float(jnp.finfo(jnp.float32).min)
CHUNK_TOKENS = 128  # keys per loop step: [C, 128] scores per head, and few loop steps


def online_softmax_step(carry, s: jax.Array, mask: jax.Array, vb: jax.Array, spec: str):
    """One key chunk of an online softmax. `carry` = (running max, sum, weighted values) over
    the chunks so far; `s`: this chunk's scores, masked where `mask` is False; `spec`: the
    einsum of probabilities and values."""
    m, l, acc = carry
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    correction = jnp.exp(m - m_new)
    l = l * correction + p.sum(axis=-1)
    acc = acc * correction[..., None] + jnp.einsum(spec, p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
    return m_new, l, acc


def online_softmax(body, start, stop, shape: tuple[int, ...], d: int) -> jax.Array:  # f32[*shape, d]
    """Runs `body(i, carry)` over key chunks [start, stop) and normalizes; a query that saw
    no key gets 0. One chunk (static 0..1) runs without a loop, so XLA fuses it freely."""
    init = (jnp.full(shape, MASK_VALUE, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros((*shape, d), jnp.float32))
    if isinstance(start, int) and isinstance(stop, int) and (start, stop) == (0, 1):
        _, l, acc = body(0, init)
    else:
        _, l, acc = jax.lax.fori_loop(start, stop, body, init)
    return acc / jnp.maximum(l, 1e-30)[..., None]


def xla_paged_attention(
    q: jax.Array,  # [Q, C, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, bs, D]
    v_pages: jax.Array,  # [Hkv, N, bs, D]
    block_tables: jax.Array,  # i32[Q, P]
    q_start: jax.Array,  # i32[Q]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
) -> jax.Array:  # [Q, C, Hq, D]
    """Paged attention (semantics in ref.py) over chunks of pages."""
    static_validate_inputs(q, k_pages, v_pages, block_tables, q_start, window)
    groups, c, heads, d = q.shape
    kv_heads, _, bs, _ = k_pages.shape
    g = heads // kv_heads
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    per_chunk = max(1, min(CHUNK_TOKENS // bs, block_tables.shape[1]))
    chunk = per_chunk * bs
    pages = block_tables.shape[1]
    if pages % per_chunk:  # whole chunks only: the extra entries point at the null page
        block_tables = jnp.pad(block_tables, ((0, 0), (0, per_chunk - pages % per_chunk)))
    qg = q.reshape(groups, c, kv_heads, g, d)
    qpos = q_start[:, None] + jnp.arange(c)  # [Q, C]

    head_ids = jnp.arange(kv_heads, dtype=jnp.int32)[:, None, None]

    def body(i, carry):
        table = jax.lax.dynamic_slice_in_dim(block_tables, i * per_chunk, per_chunk, axis=1)  # [Q, per_chunk]
        # (kv head, page) index pairs: the gather's indexed dimensions lead the cache, so XLA
        # can read the pages in place (`k_pages[:, table]` may transpose the whole cache first).
        kb = k_pages[head_ids, table[None]].reshape(kv_heads, groups, chunk, d)
        vb = v_pages[head_ids, table[None]].reshape(kv_heads, groups, chunk, d)
        kpos = i * chunk + jnp.arange(chunk)
        mask = key_mask(qpos[:, :, None], kpos[None, None, :], window)[:, None, None]  # [Q, 1, 1, C, chunk]
        s = jnp.einsum("qtkgd,kqsd->qkgts", qg, kb, preferred_element_type=jnp.float32) * scale
        return online_softmax_step(carry, s, mask, vb, "qkgts,kqsd->qkgtd")

    if block_tables.shape[1] == per_chunk:
        start, stop = 0, 1
    else:  # only the chunks some query reaches (and, with a window, no chunk wholly before it)
        stop = (jnp.max(q_start) + c - 1) // chunk + 1
        start = 0 if window is None else jnp.maximum(jnp.min(q_start) - window + 1, 0) // chunk
    out = online_softmax(body, start, stop, (groups, kv_heads, g, c), d)  # [Q, Hkv, G, C, D]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(q.shape).astype(q.dtype)
