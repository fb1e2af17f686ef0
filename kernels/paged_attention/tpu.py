"""Paged attention on TPU (Mosaic): one grid step per (group, block of kv heads, page).

Grid (Q, Hkv / hb, P). A group's queries for hb kv heads, [hb, C * G, D] with the G query
heads that share each, stay in VMEM across the page axis; each step's K and V blocks are
one page [hb, bs, D] of those heads, picked by the block table through scalar prefetch (the
page index map), so the DMA engine fetches exactly the group's own pages, tile-aligned
(bs, D). hb is as many heads as fit VMEM (all of them for decode): a step has a fixed
cost, and one head's page alone is too little work to hide it (TPU v5e, Llama-3-8B decode:
one head per step read 124 GB/s, under the XLA formulation's 300).
Steps past the group's last query position, or wholly before its window, repeat the
previous block index (no copy) and skip the compute. An online softmax over pages keeps
running max and sum as [C * G, 128] lane-replicated scratch, as Mosaic prefers.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.common import TPU_LANES, mxu_dot
from kernels.paged_attention.validate import static_validate_inputs

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: exp(mask - mask) stays 1, never NaN
LANES = TPU_LANES


def _page_range(start, c: int, bs: int, window: int | None):
    """First and last page a group with queries at [start, start + c) reads."""
    # lax.div (truncating) on these non-negative values: `//` lowers through sign(), which
    # Mosaic lowers only when it knows the TPU generation.
    last = jax.lax.div(start + c - 1, bs)
    first = 0 if window is None else jax.lax.div(jnp.maximum(start - window + 1, 0), bs)
    return first, last


def _kernel(tables_ref, starts_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *,
            sm_scale: float, window: int | None, c: int, g: int, bs: int, pages: int, hb: int):
    group, page = pl.program_id(0), pl.program_id(2)
    start = starts_ref[group]
    first, last = _page_range(start, c, bs, window)

    @pl.when(page == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((page >= first) & (page <= last))
    def _step():
        for h in range(hb):  # the step's kv heads, each with its G query heads
            s = mxu_dot(q_ref[h], k_ref[h], (((1,), (1,)), ((), ()))) * sm_scale  # [C*G, bs]
            qpos = start + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, s.shape, 0), g)
            kpos = page * bs + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            delta = qpos - kpos
            mask = delta >= 0
            if window is not None:
                mask &= delta < window
            s = jnp.where(mask, s, MASK_VALUE)
            m_prev = m_ref[h]  # [C*G, 128], every lane equal
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_col = jnp.max(m_next, axis=1, keepdims=True)  # [C*G, 1]
            p = jnp.where(mask, jnp.exp(s - m_col), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
            m_ref[h] = m_next
            pv = mxu_dot(p.astype(v_ref.dtype), v_ref[h], (((1,), (0,)), ((), ())))
            acc_ref[h] = acc_ref[h] * jnp.max(alpha, axis=1, keepdims=True) + pv

    @pl.when(page == pages - 1)
    def _finish():
        for h in range(hb):
            l = jnp.max(l_ref[h], axis=1, keepdims=True)
            o_ref[h] = (acc_ref[h] / jnp.maximum(l, 1e-30)).astype(o_ref.dtype)


# VMEM a grid step may take (its double-buffered blocks and the softmax scratch): well under
# the 16 MiB Mosaic allows a kernel by default.
VMEM_BUDGET = 8 << 20


def heads_per_step(kv_heads: int, rows: int, bs: int, d: int, itemsize: int) -> int:
    """The most kv heads (a divisor of kv_heads) one grid step takes within VMEM_BUDGET.

    A step costs a fixed overhead beside its DMA, and one page of one head is small ([bs, D],
    32 KiB at 128 x 128 bf16): a decode step of one head per page is mostly overhead, so a step
    takes every head it can. `rows` = C * G query rows per head."""
    def step_bytes(hb: int) -> int:
        blocks = 2 * hb * (2 * bs * d + 2 * rows * d) * itemsize  # K, V, q, out; double-buffered
        return blocks + hb * rows * (2 * LANES + d) * 4  # m, l, acc
    fits = [hb for hb in range(1, kv_heads + 1) if kv_heads % hb == 0 and step_bytes(hb) <= VMEM_BUDGET]
    return max(fits, default=1)


def tpu_paged_attention(
    q: jax.Array,  # [Q, C, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, bs, D]
    v_pages: jax.Array,  # [Hkv, N, bs, D]
    block_tables: jax.Array,  # i32[Q, P]
    q_start: jax.Array,  # i32[Q]
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [Q, C, Hq, D]
    """Paged attention (semantics in ref.py) as a Mosaic kernel; `interpret` runs it on CPU."""
    static_validate_inputs(q, k_pages, v_pages, block_tables, q_start, window)
    groups, c, heads, d = q.shape
    kv_heads, _, bs, _ = k_pages.shape
    g = heads // kv_heads
    pages = block_tables.shape[1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    # [Q, Hkv, C*G, D]: a kv head's query heads, for every query of the group, as one block.
    qh = q.reshape(groups, c, kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(groups, kv_heads, c * g, d)

    hb = heads_per_step(kv_heads, c * g, bs, d, jnp.dtype(k_pages.dtype).itemsize)

    def page_index(group, head, page, tables, starts):
        first, last = _page_range(starts[group], c, bs, window)
        return head, tables[group * pages + jnp.clip(page, first, last)], 0, 0

    def q_index(group, head, page, tables, starts):
        return group, head, 0, 0

    out = pl.pallas_call(
        functools.partial(_kernel, sm_scale=scale, window=window, c=c, g=g, bs=bs, pages=pages, hb=hb),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(groups, kv_heads // hb, pages),
            in_specs=[
                pl.BlockSpec((None, hb, c * g, d), q_index),
                pl.BlockSpec((hb, None, bs, d), page_index),
                pl.BlockSpec((hb, None, bs, d), page_index),
            ],
            out_specs=pl.BlockSpec((None, hb, c * g, d), q_index),
            scratch_shapes=[
                pltpu.VMEM((hb, c * g, LANES), jnp.float32),
                pltpu.VMEM((hb, c * g, LANES), jnp.float32),
                pltpu.VMEM((hb, c * g, d), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        out_shape=jax.ShapeDtypeStruct(qh.shape, q.dtype),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_attention",
    )(block_tables.reshape(-1), q_start, qh, k_pages, v_pages)
    return out.reshape(groups, kv_heads, c, g, d).transpose(0, 2, 1, 3, 4).reshape(q.shape)
