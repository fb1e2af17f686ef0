"""The reference of paged attention: every group's pages gathered into one dense sequence.

Semantics (shared by every formulation): query c of group g sits at position
p = q_start[g] + c and attends to the keys at positions k with k <= p and p - k < window
(no window: every k <= p), where position k of group g lives in page
block_tables[g, k // bs] at offset k % bs. Pages are [Hkv, N, bs, D] per K and V.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from kernels.paged_attention.validate import static_validate_inputs


def key_mask(qpos: jax.Array, kpos: jax.Array, window: int | None) -> jax.Array:
    """Which keys each query sees: kpos <= qpos and within the window (broadcasting)."""
    delta = qpos - kpos
    visible = delta >= 0
    return visible if window is None else visible & (delta < window)


def ref_paged_attention(
    q: jax.Array,  # [Q, C, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, bs, D]
    v_pages: jax.Array,  # [Hkv, N, bs, D]
    block_tables: jax.Array,  # i32[Q, P]
    q_start: jax.Array,  # i32[Q]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
) -> jax.Array:  # [Q, C, Hq, D]
    """Dense softmax attention over each group's gathered pages (memory grows with P * bs)."""
    static_validate_inputs(q, k_pages, v_pages, block_tables, q_start, window)
    groups, c, heads, d = q.shape
    kv_heads, _, bs, _ = k_pages.shape
    g = heads // kv_heads
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    k = k_pages[:, block_tables].reshape(kv_heads, groups, -1, d)  # [Hkv, Q, P*bs, D]
    v = v_pages[:, block_tables].reshape(kv_heads, groups, -1, d)
    qg = q.reshape(groups, c, kv_heads, g, d)
    s = jnp.einsum("qtkgd,kqsd->qkgts", qg, k, preferred_element_type=jnp.float32) * scale
    qpos = q_start[:, None] + jnp.arange(c)  # [Q, C]
    kpos = jnp.arange(k.shape[2])
    mask = key_mask(qpos[:, :, None], kpos[None, None, :], window)[:, None, None]  # [Q, 1, 1, C, S]
    probs = jax.nn.softmax(jnp.where(mask, s, jnp.finfo(jnp.float32).min), axis=-1)
    out = jnp.einsum("qkgts,kqsd->qtkgd", probs, v.astype(jnp.float32))
    return out.reshape(q.shape).astype(q.dtype)
