"""TPU (Mosaic) LoRA shrink and expand: megablox-style visits over slot-sorted m-tiles.

Both ops run on these kernels on TPU: sgmv (prefill, tm of 128 rows) and bgmv (decode, tm of
one sublane tile), see kernels.dispatch.

x is sorted by slot (one copy, rounded up to whole tiles; no per-segment padding). The
visit -> (tile, slot, row range) tables are scalar-prefetched and index the BlockSpecs.
A tile's first visit zeroes its output block; each visit writes only its segment's rows.
The pool stays in HBM, stacked over layers: the kernels DMA each visit's slot block of the
scalar-prefetched layer themselves (kernels.slot_stream), once for a run of one slot's visits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.common import mxu_dot
from kernels.sgmv.metadata import GroupMetadata
from kernels.slot_stream import HBM, SlotStream, expand_params, fetch_plan, in_hbm, scratch, shrink_params

_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


def interpret_params(interpret: bool):
    """TPU semantics on CPU when interpreting (Mosaic's tiling and DMA model)."""
    return pltpu.InterpretParams() if interpret else False


def lane_block(dim: int, preferred: int) -> int:
    """Largest multiple of 128 dividing `dim`, at most `preferred`; else the full dim."""
    best = 0
    for cand in range(128, min(dim, preferred) + 1, 128):
        if dim % cand == 0:
            best = cand
    return best or dim


def sorted_rows(
    x: jax.Array,  # [T, in]
    meta: GroupMetadata,
    tm: int,
) -> jax.Array:  # [ceil(T/tm)*tm, in] slot-sorted
    """x in sorted order, rounded up to whole m-tiles."""
    num_tokens = x.shape[0]
    rows = -(-num_tokens // tm) * tm
    src = meta.order[jnp.minimum(jnp.arange(rows), num_tokens - 1)]
    return x[src]


def _row_mask(v, tile_ref, lo_ref, hi_ref, tm, width):
    rows = tile_ref[v] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, width), 0)
    return (rows >= lo_ref[v]) & (rows < hi_ref[v])


def _first_visit(v, tile_ref):
    return (v == 0) | (tile_ref[jnp.maximum(v - 1, 0)] != tile_ref[v])


def _shrink_kernel(tile_ref, slot_ref, lo_ref, hi_ref, new_ref, idx_ref, cnt_ref, layer_ref, x_ref, a_hbm, o_ref,
                   buf, sem, *, tm, steps):
    v = pl.program_id(0)
    stream = SlotStream(a_hbm, buf, sem, layer_ref, slot_ref, new_ref, idx_ref, cnt_ref, steps)

    @pl.when(_first_visit(v, tile_ref))
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(stream.active(v))
    def _():
        a = stream.block(0, v)
        d = mxu_dot(x_ref[...], a[...], _NT)
        mask = _row_mask(v, tile_ref, lo_ref, hi_ref, tm, o_ref.shape[1])
        o_ref[...] = jnp.where(mask, d, o_ref[...])


def _prefetch(meta: GroupMetadata, layer: jax.Array) -> tuple[jax.Array, ...]:
    new, index, counts = fetch_plan(meta.visit_slot, meta.num_visits)
    return meta.visit_tile, meta.visit_slot, meta.visit_lo, meta.visit_hi, new, index, counts, layer


def shrink(
    x_sorted: jax.Array,  # [Tp, in] slot-sorted, Tp a multiple of tm
    a: jax.Array,  # [L, S, n*R, in]
    layer: jax.Array,  # i32[1]
    meta: GroupMetadata,
    *,
    tm: int,
    bk: int,
    interpret: bool = False,
) -> jax.Array:  # f32[Tp, n*R] unscaled, sorted rows; no-adapter rows zero
    """Grouped x @ A[slot]ᵀ over visits, K whole (`bk` is not used: a visit's A rows are one
    DMA from the pool in HBM, kernels.slot_stream)."""
    del bk
    rows, in_features = x_sorted.shape
    nr = a.shape[2]
    steps = meta.grid_visits
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=8,
        grid=(steps,),
        in_specs=[
            pl.BlockSpec((tm, in_features), lambda v, tile, *_: (tile[v], 0)),
            pl.BlockSpec(memory_space=HBM),
        ],
        out_specs=pl.BlockSpec((tm, nr), lambda v, tile, *_: (tile[v], 0)),
        scratch_shapes=scratch(nr, in_features, a.dtype),
    )
    return pl.pallas_call(
        functools.partial(_shrink_kernel, tm=tm, steps=steps),
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((rows, nr), jnp.float32),
        compiler_params=shrink_params(tm, x_sorted, a),
        interpret=interpret_params(interpret),
        name="lora_sgmv_shrink",
    )(*_prefetch(meta, layer), x_sorted, in_hbm(a))


def _expand_kernel(tile_ref, slot_ref, lo_ref, hi_ref, new_ref, idx_ref, cnt_ref, layer_ref, v_ref, b_hbm, o_ref,
                   buf, sem, *, tm, steps, passes):
    j, v = pl.program_id(0), pl.program_id(1)
    stream = SlotStream(b_hbm, buf, sem, layer_ref, slot_ref, new_ref, idx_ref, cnt_ref, steps, passes)

    @pl.when(_first_visit(v, tile_ref))
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(stream.active(v))
    def _():
        b = stream.block(j, v)
        d = mxu_dot(v_ref[...].astype(b.dtype), b[...], _NN)
        mask = _row_mask(v, tile_ref, lo_ref, hi_ref, tm, o_ref.shape[1])
        o_ref[...] = jnp.where(mask, d, o_ref[...])


def expand(
    v_sorted: jax.Array,  # f32[Tp, R] one slice, scaled, sorted rows
    b: jax.Array,  # [L, S, R, out]
    layer: jax.Array,  # i32[1]
    meta: GroupMetadata,
    *,
    tm: int,
    bn: int,
    interpret: bool = False,
) -> jax.Array:  # f32[Tp, out] delta in sorted rows
    """Grouped v @ B[slot]; grid (out blocks, visits)."""
    rows, rank = v_sorted.shape
    out_features = b.shape[3]
    bn = lane_block(out_features, bn)
    steps, passes = meta.grid_visits, out_features // bn
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=8,
        grid=(passes, steps),
        in_specs=[
            pl.BlockSpec((tm, rank), lambda j, v, tile, *_: (tile[v], 0)),
            pl.BlockSpec(memory_space=HBM),
        ],
        out_specs=pl.BlockSpec((tm, bn), lambda j, v, tile, *_: (tile[v], j)),
        scratch_shapes=scratch(rank, bn, b.dtype),
    )
    return pl.pallas_call(
        functools.partial(_expand_kernel, tm=tm, steps=steps, passes=passes),
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((rows, out_features), jnp.float32),
        compiler_params=expand_params(tm, bn, b),
        interpret=interpret_params(interpret),
        name="lora_sgmv_expand",
    )(*_prefetch(meta, layer), v_sorted, in_hbm(b))
