"""TPU (Mosaic) LoRA shrink and expand over slot-sorted, padded token blocks.

Tokens are sorted by slot inside the jit and laid out in blocks of `tm` rows that share
one slot (kernels.common tile layout; a block's unused rows are zero). The block -> slot
map is scalar-prefetched. The pool stays in HBM, stacked over layers: the kernels DMA the
block of the scalar-prefetched layer and each tile's slot themselves (kernels.slot_stream),
double-buffered, once for a run of tiles of one slot, so each distinct adapter's A is read
once (K whole) and its B once per output column pass. Blocks past the real count map onto
the last real block and do nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.common import TileMetadata, mxu_dot
from kernels.slot_stream import HBM, SlotStream, expand_params, fetch_plan, in_hbm, scratch, shrink_params


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


def padded_rows(
    x: jax.Array,  # [T, in]
    meta: TileMetadata,
    tm: int,
) -> jax.Array:  # [G*tm, in], block g holds tile g's tokens, zero rows past its end
    """Tile-layout copy of x (decode batches are small, so the copy is cheap)."""
    pos = meta.tile_start[:, None] + jnp.arange(tm, dtype=jnp.int32)[None, :]
    valid = (pos < meta.tile_end[:, None]).reshape(-1)
    tok = meta.order[jnp.minimum(pos.reshape(-1), x.shape[0] - 1)]
    return jnp.where(valid[:, None], x[tok], jnp.zeros((), x.dtype))


def effective_tiles(meta: TileMetadata) -> jax.Array:  # i32[G]
    """Tile g itself when real, else the last real tile (no new DMA, output kept)."""
    g = jnp.arange(meta.grid_tiles, dtype=jnp.int32)
    return jnp.minimum(g, jnp.maximum(meta.num_tiles - 1, 0))


def _shrink_kernel(slot_ref, eff_ref, new_ref, idx_ref, cnt_ref, layer_ref, x_ref, a_hbm, o_ref, buf, sem,
                   *, steps):
    g = pl.program_id(0)
    stream = SlotStream(a_hbm, buf, sem, layer_ref, slot_ref, new_ref, idx_ref, cnt_ref, steps)

    @pl.when(stream.active(g))
    def _():
        a = stream.block(0, g)
        o_ref[...] = mxu_dot(x_ref[...], a[...], (((1,), (1,)), ((), ())))

    @pl.when((cnt_ref[0] == 0) & (g == 0))
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)


def shrink(
    x_pad: jax.Array,  # [G*tm, in] tile layout
    a: jax.Array,  # [L, S, n*R, in]
    layer: jax.Array,  # i32[1]
    meta: TileMetadata,
    *,
    tm: int,
    bk: int,
    interpret: bool = False,
) -> jax.Array:  # f32[G*tm, n*R] unscaled
    """Per-block x @ A[slot]ᵀ, K whole (`bk` is not used: a block's A rows are one DMA)."""
    del bk
    rows, in_features = x_pad.shape
    nr = a.shape[2]
    steps = meta.grid_tiles
    new, index, counts = fetch_plan(meta.tile_slot, meta.num_tiles)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(steps,),
        in_specs=[
            pl.BlockSpec((tm, in_features), lambda g, slot, eff, *_: (eff[g], 0)),
            pl.BlockSpec(memory_space=HBM),
        ],
        out_specs=pl.BlockSpec((tm, nr), lambda g, slot, eff, *_: (eff[g], 0)),
        scratch_shapes=scratch(nr, in_features, a.dtype),
    )
    return pl.pallas_call(
        functools.partial(_shrink_kernel, steps=steps),
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((rows, nr), jnp.float32),
        compiler_params=shrink_params(tm, x_pad, a),
        interpret=interpret_params(interpret),
        name="lora_shrink_blocks",
    )(meta.tile_slot, effective_tiles(meta), new, index, counts, layer, x_pad, in_hbm(a))


def _expand_kernel(slot_ref, eff_ref, new_ref, idx_ref, cnt_ref, layer_ref, v_ref, b_hbm, o_ref, buf, sem,
                   *, steps, passes):
    j, g = pl.program_id(0), pl.program_id(1)
    stream = SlotStream(b_hbm, buf, sem, layer_ref, slot_ref, new_ref, idx_ref, cnt_ref, steps, passes)

    @pl.when(stream.active(g))
    def _():
        b = stream.block(j, g)
        o_ref[...] = mxu_dot(v_ref[...].astype(b.dtype), b[...], (((1,), (0,)), ((), ())))

    @pl.when((cnt_ref[0] == 0) & (g == 0))
    def _():
        o_ref[...] = jnp.zeros_like(o_ref)


def expand(
    v_pad: jax.Array,  # f32[G*tm, R] one slice, scaled, tile layout
    b: jax.Array,  # [L, S, R, out]
    layer: jax.Array,  # i32[1]
    meta: TileMetadata,
    *,
    tm: int,
    bn: int,
    interpret: bool = False,
) -> jax.Array:  # f32[G*tm, out] delta in tile layout
    """Per-block v @ B[slot]; grid (out blocks, tiles), so with one out block (bn covers
    the width) each slot's B is read once."""
    rows, rank = v_pad.shape
    out_features = b.shape[3]
    bn = lane_block(out_features, bn)
    steps, passes = meta.grid_tiles, out_features // bn
    new, index, counts = fetch_plan(meta.tile_slot, meta.num_tiles)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(passes, steps),
        in_specs=[
            pl.BlockSpec((tm, rank), lambda j, g, slot, eff, *_: (eff[g], 0)),
            pl.BlockSpec(memory_space=HBM),
        ],
        out_specs=pl.BlockSpec((tm, bn), lambda j, g, slot, eff, *_: (eff[g], j)),
        scratch_shapes=scratch(rank, bn, b.dtype),
    )
    return pl.pallas_call(
        functools.partial(_expand_kernel, steps=steps, passes=passes),
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((rows, out_features), jnp.float32),
        compiler_params=expand_params(tm, bn, b),
        interpret=interpret_params(interpret),
        name="lora_expand_blocks",
    )(meta.tile_slot, effective_tiles(meta), new, index, counts, layer, v_pad, in_hbm(b))


def scale_rows(
    v_pad: jax.Array,  # f32[G*tm, C]
    slot_scalings: jax.Array,  # f32[S]
    meta: TileMetadata,
    tm: int,
) -> jax.Array:  # f32[G*tm, C]
    """Applies each block's slot scaling to its rows."""
    return v_pad * jnp.repeat(slot_scalings[meta.tile_slot], tm)[:, None]

