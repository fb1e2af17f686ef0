"""TPU (Mosaic) SGMV shrink and expand: megablox-style visits over slot-sorted m-tiles.

x is sorted by slot (one copy, rounded up to whole tiles; no per-segment padding). The
visit -> (tile, slot, row range) tables are scalar-prefetched and index the BlockSpecs.
A tile's first visit zeroes its output block; each visit writes only its segment's rows.
The pool is stacked over layers; the layer index is scalar-prefetched (read in place).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.bgmv.tpu import interpret_params, lane_block
from kernels.common import mxu_dot
from kernels.sgmv.metadata import GroupMetadata

_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


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


def _shrink_kernel(tile_ref, slot_ref, lo_ref, hi_ref, layer_ref, x_ref, a_ref, o_ref, acc_ref, *, tm, nk):
    v, k = pl.program_id(0), pl.program_id(1)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(lo_ref[v] < hi_ref[v])
    def _():
        acc_ref[...] += mxu_dot(x_ref[...], a_ref[...], _NT)

    @pl.when(k == nk - 1)
    def _():
        @pl.when(_first_visit(v, tile_ref))
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        mask = _row_mask(v, tile_ref, lo_ref, hi_ref, tm, o_ref.shape[1])
        o_ref[...] = jnp.where(mask, acc_ref[...], o_ref[...])


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
    """Grouped x @ A[slot]ᵀ over visits, K tiled by bk."""
    rows, in_features = x_sorted.shape
    nr = a.shape[2]
    bk = lane_block(in_features, bk)
    nk = in_features // bk
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(meta.grid_visits, nk),
        in_specs=[
            pl.BlockSpec((tm, bk), lambda v, k, tile, slot, lo, hi, lyr: (tile[v], k)),
            pl.BlockSpec((None, None, nr, bk), lambda v, k, tile, slot, lo, hi, lyr: (lyr[0], slot[v], 0, k)),
        ],
        out_specs=pl.BlockSpec((tm, nr), lambda v, k, tile, slot, lo, hi, lyr: (tile[v], 0)),
        scratch_shapes=[pltpu.VMEM((tm, nr), jnp.float32)],
    )
    return pl.pallas_call(
        functools.partial(_shrink_kernel, tm=tm, nk=nk),
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((rows, nr), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret_params(interpret),
        name="lora_sgmv_shrink",
    )(meta.visit_tile, meta.visit_slot, meta.visit_lo, meta.visit_hi, layer, x_sorted, a)


def _expand_kernel(tile_ref, slot_ref, lo_ref, hi_ref, layer_ref, v_ref, b_ref, o_ref, *, tm):
    v = pl.program_id(1)

    @pl.when(_first_visit(v, tile_ref))
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)

    @pl.when(lo_ref[v] < hi_ref[v])
    def _():
        d = mxu_dot(v_ref[...].astype(b_ref.dtype), b_ref[...], _NN)
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
    """Grouped v @ B[slot]; grid (out tiles, visits)."""
    rows, rank = v_sorted.shape
    out_features = b.shape[3]
    bn = lane_block(out_features, bn)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(out_features // bn, meta.grid_visits),
        in_specs=[
            pl.BlockSpec((tm, rank), lambda j, v, tile, slot, lo, hi, lyr: (tile[v], 0)),
            pl.BlockSpec((None, None, rank, bn), lambda j, v, tile, slot, lo, hi, lyr: (lyr[0], slot[v], 0, j)),
        ],
        out_specs=pl.BlockSpec((tm, bn), lambda j, v, tile, slot, lo, hi, lyr: (tile[v], j)),
    )
    return pl.pallas_call(
        functools.partial(_expand_kernel, tm=tm),
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((rows, out_features), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret_params(interpret),
        name="lora_sgmv_expand",
    )(meta.visit_tile, meta.visit_slot, meta.visit_lo, meta.visit_hi, layer, v_sorted, b)
