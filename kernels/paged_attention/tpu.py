"""Paged attention on TPU (Mosaic).

Chunks of queries (prefill, extend): one grid step per (group, block of kv heads, block of
queries, page). Grid (Q, Hkv / hb, C / cq, P). A block of cq of a group's queries for hb kv
heads, [hb, cq * G, D] with the G query heads that share each, stays in VMEM across the page
axis (cq = C unless that overflows VMEM: a long chunk is cut into blocks); each step's K and
V blocks are one page [hb, bs, D] of those heads, picked by the block table through scalar prefetch (the
page index map), so the DMA engine fetches exactly the group's own pages, tile-aligned
(bs, D). hb is as many heads as fit VMEM: a step has a fixed cost, and one head's page
alone is too little work to hide it (TPU v5e, Llama-3-8B decode, when it ran through this
kernel: one head per step read 124 GB/s, under the XLA formulation's 300).
Steps past the group's last query position, or wholly before its window, repeat the
previous block index (no copy) and skip the compute. An online softmax over pages keeps
running max and sum as [cq * G, 128] lane-replicated scratch, as Mosaic prefers.

Decode (one query per group): a step takes DECODE_PAGES pages of hb kv heads and computes
every head at once, in one product of the step's [hb * G, D] queries against its
[pages * hb * bs, D] keys, then one of the probabilities against the values; the scores of
a head's queries against another head's keys are masked off (a block-diagonal product).
With G = 4 query rows per head, a product per head was a chain of small dependent ones
(16 a step for 8 heads) that left the DMA engine waiting: on a TPU v5e chip, Llama-3-8B
shapes, it read 420 GB/s where the page DMAs alone run at 740; one product per step reads
600, two pages a step 735-745 (the DMAs' rate), for hb times the multiply-adds, which the
MXU has to spare at decode.
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
    """One step: a page of hb kv heads against a block of c queries (c * G rows a head)."""
    group, page = pl.program_id(0), pl.program_id(3)
    start = starts_ref[group] + pl.program_id(2) * c  # the block's first query position
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


# VMEM a grid step may take (its double-buffered blocks, the softmax scratch and a head's
# scores): well under the 16 MiB Mosaic allows a kernel by default.
VMEM_BUDGET = 8 << 20
SCORE_COPIES = 5  # [rows, bs] f32 arrays a head's step keeps live: scores, positions, mask, p


def _step_bytes(hb: int, rows: int, bs: int, d: int, itemsize: int) -> int:
    blocks = 2 * hb * (2 * bs * d + 2 * rows * d) * itemsize  # K, V, q, out; double-buffered
    return blocks + hb * rows * (2 * LANES + d) * 4 + SCORE_COPIES * rows * bs * 4  # m, l, acc; scores


def heads_per_step(kv_heads: int, rows: int, bs: int, d: int, itemsize: int) -> int:
    """The most kv heads (a divisor of kv_heads) one grid step takes within VMEM_BUDGET.

    A step costs a fixed overhead beside its DMA, and one page of one head is small ([bs, D],
    32 KiB at 128 x 128 bf16): a step of one head per page is mostly overhead for a short
    chunk, so a step takes every head it can. `rows` = C * G query rows per head."""
    fits = [hb for hb in range(1, kv_heads + 1)
            if kv_heads % hb == 0 and _step_bytes(hb, rows, bs, d, itemsize) <= VMEM_BUDGET]
    return max(fits, default=1)


def queries_per_step(c: int, g: int, bs: int, d: int, itemsize: int) -> int:
    """The queries of a chunk one grid step takes: all c where one head's step fits
    VMEM_BUDGET, else the most (a divisor of c, its rows whole sublane tiles) that do; a
    2048-token chunk of Llama-3-8B's 4 query heads a kv head asked for 30 MiB as one block."""
    fits = [cq for cq in range(1, c + 1) if c % cq == 0 and (cq == c or cq * g % 16 == 0)]
    within = [cq for cq in fits if _step_bytes(1, cq * g, bs, d, itemsize) <= VMEM_BUDGET]
    return max(within, default=min(fits))


def _decode_kernel(tables_ref, starts_ref, q_ref, *refs, sm_scale: float, window: int | None, g: int, bs: int,
                   hb: int, per: int):
    """One decode step: `per` pages of hb kv heads against the [hb * G, D] queries at once."""
    k_refs, v_refs = refs[:per], refs[per:2 * per]
    o_ref, m_ref, l_ref, acc_ref = refs[2 * per:]
    group, step = pl.program_id(0), pl.program_id(2)
    page = step * per  # the step's first page
    start = starts_ref[group]
    first, last = _page_range(start, 1, bs, window)

    @pl.when(step == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when((page + per - 1 >= first) & (page <= last))
    def _step():
        d = q_ref.shape[-1]

        def keys(refs):  # [per * hb * bs, D]: the step's pages, each head's page after the other
            blocks = [r[...].reshape(hb * bs, d) for r in refs]
            return blocks[0] if per == 1 else jnp.concatenate(blocks, axis=0)

        k, v = keys(k_refs), keys(v_refs)
        s = mxu_dot(q_ref[...], k, (((1,), (1,)), ((), ()))) * sm_scale  # [hb * G, per * hb * bs]
        row = jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        col = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        within = jax.lax.rem(col, hb * bs)  # column = (page of the step, head, offset in the page)
        delta = start - ((page + jax.lax.div(col, hb * bs)) * bs + jax.lax.rem(within, bs))
        mask = (jax.lax.div(row, g) == jax.lax.div(within, bs)) & (delta >= 0)  # its own head's keys
        if window is not None:
            mask &= delta < window
        s = jnp.where(mask, s, MASK_VALUE)
        m_prev = m_ref[...]  # [hb * G, 128], every lane equal
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - jnp.max(m_next, axis=1, keepdims=True)), 0.0)
        alpha = jnp.exp(m_prev - m_next)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        pv = mxu_dot(p.astype(v.dtype), v, (((1,), (0,)), ((), ())))  # [hb * G, D]
        acc_ref[...] = acc_ref[...] * jnp.max(alpha, axis=1, keepdims=True) + pv

    @pl.when(step == pl.num_programs(2) - 1)
    def _finish():
        l = jnp.max(l_ref[...], axis=1, keepdims=True)
        o_ref[...] = (acc_ref[...] / jnp.maximum(l, 1e-30)).astype(o_ref.dtype)


DECODE_PAGES = 2  # pages a decode step takes (4 read the same on TPU v5e, and more for a short table)
DECODE_COLUMNS = 1024  # keys of a decode step's page across its heads (hb * bs), at most


def decode_heads_per_step(kv_heads: int, g: int, bs: int) -> int:
    """The kv heads one decode step computes at once: the most (a divisor of kv_heads, its
    query rows whole sublane tiles, or every head) whose keys of a page stay within
    DECODE_COLUMNS (the block-diagonal product costs hb times its useful work); where none
    does (one query head a kv head: 16 heads make a tile), the fewest."""
    tiled = [hb for hb in range(1, kv_heads + 1) if kv_heads % hb == 0 and (hb == kv_heads or hb * g % 16 == 0)]
    fits = [hb for hb in tiled if hb * bs <= DECODE_COLUMNS]
    return max(fits) if fits else min(tiled)


def _tpu_decode_attention(q, k_pages, v_pages, block_tables, q_start, *, scale: float, window: int | None,
                          interpret: bool) -> jax.Array:
    groups, _, heads, d = q.shape
    kv_heads, _, bs, _ = k_pages.shape
    g = heads // kv_heads
    pages = block_tables.shape[1]
    per = min(DECODE_PAGES, pages)
    hb = decode_heads_per_step(kv_heads, g, bs)
    qh = q.reshape(groups, heads, d)  # a kv head's G query heads are consecutive

    def page_index(j: int):
        def index(group, head, step, tables, starts):
            first, last = _page_range(starts[group], 1, bs, window)
            return head, tables[group * pages + jnp.clip(step * per + j, first, last)], 0, 0
        return index

    def q_index(group, head, step, tables, starts):
        return group, head, 0

    # The cache goes in once per page of a step, each with its own index map: their DMAs run
    # together.
    page_specs = [pl.BlockSpec((hb, None, bs, d), page_index(j)) for j in range(per)]
    out = pl.pallas_call(
        functools.partial(_decode_kernel, sm_scale=scale, window=window, g=g, bs=bs, hb=hb, per=per),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(groups, kv_heads // hb, -(-pages // per)),
            in_specs=[pl.BlockSpec((None, hb * g, d), q_index), *page_specs, *page_specs],
            out_specs=pl.BlockSpec((None, hb * g, d), q_index),
            scratch_shapes=[
                pltpu.VMEM((hb * g, LANES), jnp.float32),
                pltpu.VMEM((hb * g, LANES), jnp.float32),
                pltpu.VMEM((hb * g, d), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        out_shape=jax.ShapeDtypeStruct(qh.shape, q.dtype),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_attention_decode",
    )(block_tables.reshape(-1), q_start, qh, *([k_pages] * per), *([v_pages] * per))
    return out.reshape(q.shape)


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
    if c == 1:
        return _tpu_decode_attention(q, k_pages, v_pages, block_tables, q_start, scale=scale, window=window,
                                     interpret=interpret)
    # [Q, Hkv, C*G, D]: a kv head's query heads, for every query of the group, as one block.
    qh = q.reshape(groups, c, kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(groups, kv_heads, c * g, d)

    itemsize = jnp.dtype(k_pages.dtype).itemsize
    cq = queries_per_step(c, g, bs, d, itemsize)
    hb = heads_per_step(kv_heads, cq * g, bs, d, itemsize)

    def page_index(group, head, block, page, tables, starts):
        first, last = _page_range(starts[group] + block * cq, cq, bs, window)
        return head, tables[group * pages + jnp.clip(page, first, last)], 0, 0

    def q_index(group, head, block, page, tables, starts):
        return group, head, block, 0

    out = pl.pallas_call(
        functools.partial(_kernel, sm_scale=scale, window=window, c=cq, g=g, bs=bs, pages=pages, hb=hb),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(groups, kv_heads // hb, c // cq, pages),
            in_specs=[
                pl.BlockSpec((None, hb, cq * g, d), q_index),
                pl.BlockSpec((hb, None, bs, d), page_index),
                pl.BlockSpec((hb, None, bs, d), page_index),
            ],
            out_specs=pl.BlockSpec((None, hb, cq * g, d), q_index),
            scratch_shapes=[
                pltpu.VMEM((hb, cq * g, LANES), jnp.float32),
                pltpu.VMEM((hb, cq * g, LANES), jnp.float32),
                pltpu.VMEM((hb, cq * g, d), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        out_shape=jax.ShapeDtypeStruct(qh.shape, q.dtype),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="paged_attention",
    )(block_tables.reshape(-1), q_start, qh, k_pages, v_pages)
    return out.reshape(groups, kv_heads, c, g, d).transpose(0, 2, 1, 3, 4).reshape(q.shape)
