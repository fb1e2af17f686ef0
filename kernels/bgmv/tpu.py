"""TPU (Mosaic) LoRA shrink and expand over slot-sorted, padded token blocks.

Tokens are sorted by slot inside the jit and laid out in blocks of `tm` rows that share
one slot (kernels.common tile layout; a block's unused rows are zero). The block -> slot
map is scalar-prefetched (PrefetchScalarGridSpec) and indexes the weight BlockSpec, so
consecutive blocks of one slot reuse the weight block already in VMEM: each distinct
adapter's A is read once (K is kept whole, see tuned_block_sizes) and its B once per
output column block. Blocks past the real count map onto the last
real block, so they cost neither a DMA nor a matmul. The pool is stacked over layers;
the layer index is scalar-prefetched too, so a layer is read in place, never sliced out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.common import TileMetadata, mxu_dot


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


def _shrink_kernel(slot_ref, eff_ref, layer_ref, x_ref, a_ref, o_ref):
    g, k = pl.program_id(0), pl.program_id(1)

    @pl.when(eff_ref[g] == g)
    def _():
        @pl.when(k == 0)
        def _():
            o_ref[...] = jnp.zeros_like(o_ref)

        o_ref[...] += mxu_dot(x_ref[...], a_ref[...], (((1,), (1,)), ((), ())))


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
    """Per-block x @ A[slot]ᵀ, K tiled by bk."""
    rows, in_features = x_pad.shape
    nr = a.shape[2]
    bk = lane_block(in_features, bk)
    grid = (meta.grid_tiles, in_features // bk)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=grid,
        in_specs=[
            pl.BlockSpec((tm, bk), lambda g, k, slot, eff, lyr: (eff[g], k)),
            pl.BlockSpec((None, None, nr, bk), lambda g, k, slot, eff, lyr: (lyr[0], slot[g], 0, k)),
        ],
        out_specs=pl.BlockSpec((tm, nr), lambda g, k, slot, eff, lyr: (eff[g], 0)),
    )
    return pl.pallas_call(
        _shrink_kernel,
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((rows, nr), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret_params(interpret),
        name="lora_shrink_blocks",
    )(meta.tile_slot, effective_tiles(meta), layer, x_pad, a)


def _expand_kernel(slot_ref, eff_ref, layer_ref, v_ref, b_ref, o_ref):
    g = pl.program_id(1)

    @pl.when(eff_ref[g] == g)
    def _():
        o_ref[...] = mxu_dot(v_ref[...].astype(b_ref.dtype), b_ref[...], (((1,), (0,)), ((), ())))


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
    """Per-block v @ B[slot]; grid (out tiles, blocks) so one slot's B block is read once."""
    rows, rank = v_pad.shape
    out_features = b.shape[3]
    bn = lane_block(out_features, bn)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(out_features // bn, meta.grid_tiles),
        in_specs=[
            pl.BlockSpec((tm, rank), lambda j, g, slot, eff, lyr: (eff[g], 0)),
            pl.BlockSpec((None, None, rank, bn), lambda j, g, slot, eff, lyr: (lyr[0], slot[g], 0, j)),
        ],
        out_specs=pl.BlockSpec((tm, bn), lambda j, g, slot, eff, lyr: (eff[g], j)),
    )
    return pl.pallas_call(
        _expand_kernel,
        grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((rows, out_features), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret_params(interpret),
        name="lora_expand_blocks",
    )(meta.tile_slot, effective_tiles(meta), layer, v_pad, b)


def scale_rows(
    v_pad: jax.Array,  # f32[G*tm, C]
    slot_scalings: jax.Array,  # f32[S]
    meta: TileMetadata,
    tm: int,
) -> jax.Array:  # f32[G*tm, C]
    """Applies each block's slot scaling to its rows."""
    return v_pad * jnp.repeat(slot_scalings[meta.tile_slot], tm)[:, None]

