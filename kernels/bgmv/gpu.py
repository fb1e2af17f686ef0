"""GPU (Pallas Triton lowering) LoRA shrink and expand over slot-sorted tiles.

One program per (tile, ...) where a tile is up to `tm` slot-sorted tokens of one slot
(kernels.common.TileMetadata, passed as ordinary inputs and read with dynamic ref
indexing). x rows and y rows are gathered / scattered through the sorted order inside
the kernel, so no padded copy of x or y is made. Rows of A and B past the slot's real
rank are masked off, so a rank-8 adapter in a rank-64 pool reads only its 8 rows. The
pool is stacked over layers and the layer is an input, read in place (no slice copy).

Shrink: grid (tiles, slices, splits); split-K because the output is only r wide, so the
in dimension has to supply the parallelism. Each split writes an f32 partial in tile
layout; the expand sums the partials, scales them and multiplies by B on the tensor
cores, adding into the base output in place (input_output_aliases).

Single launch (BlockSizes.single_launch, the fused op only): one program per (tile,
column block) does the whole-K shrink of its tile and then its block of the expand, so
one launch replaces two and no partials go through memory; A is re-read per column block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels.common import TileMetadata, cdiv

_NT = (((1,), (1,)), ((), ()))  # a @ bᵀ
_NN = (((1,), (0,)), ((), ()))  # a @ b


def rank_tile(max_rank: int) -> int:
    """Rank tile: a power of two >= 16 (the smallest tensor-core operand)."""
    return max(16, 1 << (max_rank - 1).bit_length())


def _compiler_params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


class _Tile:
    """What every program of one tile reads first: its slot, layer, tokens and rank mask."""

    def __init__(self, g, layer_ref, tile_slot_ref, tile_start_ref, tile_end_ref, order_ref, ranks_ref, *,
                 tm: int, rp: int, max_rank: int):
        start, end = tile_start_ref[g], tile_end_ref[g]
        self.slot, self.layer = tile_slot_ref[g], layer_ref[0]
        rank = jnp.minimum(ranks_ref[self.slot], max_rank)
        # Rows past the tile's end repeat its last token: they compute and store the
        # same values as that token, so no lane needs a mask (a masked-off lane would
        # still alias a real row in interpret mode's scatter).
        rows = jnp.minimum(start + jnp.arange(tm, dtype=jnp.int32), end - 1)
        self.tok = order_ref[rows]
        self.rr = jnp.arange(rp, dtype=jnp.int32)
        self.rmask = self.rr < rank
        self.pool_rows = jnp.minimum(self.rr, max_rank - 1)  # in range even where masked
        self.tm, self.rp, self.max_rank = tm, rp, max_rank


def _shrink_blocks(t: _Tile, x_ref, a_ref, i: int, first_block, num_blocks: int, *, bk: int, in_features: int):
    """f32[tm, rp] = x[tok] @ A_i[slot]ᵀ over K blocks [first_block, first_block + num_blocks)."""
    a_rows = i * t.max_rank + t.pool_rows

    def body(kb, acc):
        cols = (first_block + kb) * bk + jnp.arange(bk, dtype=jnp.int32)
        cmask = cols < in_features
        xb = plgpu.load(
            x_ref.at[t.tok[:, None], cols[None, :]], mask=jnp.broadcast_to(cmask[None, :], (t.tm, bk)), other=0,
        )
        ab = plgpu.load(
            a_ref.at[t.layer, t.slot, a_rows[:, None], cols[None, :]], mask=t.rmask[:, None] & cmask[None, :], other=0,
        )
        return acc + lax.dot_general(xb, ab, _NT, preferred_element_type=jnp.float32)

    return lax.fori_loop(0, num_blocks, body, jnp.zeros((t.tm, t.rp), jnp.float32))


def _expand_store(t: _Tile, v, b_ref, base_ref, y_ref, j, *, bn: int, out_features: int):
    """y[tok, block j] = base[tok, block j] + v @ B[slot][:, block j]; v f32[tm, rp] scaled."""
    cols = j * bn + jnp.arange(bn, dtype=jnp.int32)
    cmask = cols < out_features
    bb = plgpu.load(
        b_ref.at[t.layer, t.slot, t.pool_rows[:, None], cols[None, :]], mask=t.rmask[:, None] & cmask[None, :],
        other=0,
    )
    delta = lax.dot_general(v.astype(bb.dtype), bb, _NN, preferred_element_type=jnp.float32)
    ymask = jnp.broadcast_to(cmask[None, :], (t.tm, bn))
    y = plgpu.load(base_ref.at[t.tok[:, None], cols[None, :]], mask=ymask, other=0)
    plgpu.store(y_ref.at[t.tok[:, None], cols[None, :]], (y.astype(jnp.float32) + delta).astype(y.dtype), mask=ymask)


def _shrink_kernel(
    layer_ref, tile_slot_ref, tile_start_ref, tile_end_ref, order_ref, ranks_ref, x_ref, a_ref,
    out_ref, *, tm: int, bk: int, rp: int, max_rank: int, blocks_per_split: int, in_features: int,
):
    g, i, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(tile_start_ref[g] < tile_end_ref[g])
    def _():
        t = _Tile(g, layer_ref, tile_slot_ref, tile_start_ref, tile_end_ref, order_ref, ranks_ref,
                  tm=tm, rp=rp, max_rank=max_rank)
        acc = _shrink_blocks(t, x_ref, a_ref, i, s * blocks_per_split, blocks_per_split, bk=bk,
                             in_features=in_features)
        out_rows = g * tm + jnp.arange(tm, dtype=jnp.int32)
        plgpu.store(out_ref.at[s, out_rows[:, None], (i * rp + t.rr)[None, :]], acc)


def shrink_partials(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [L, S, n*R, in]
    layer: jax.Array,  # i32[1]
    slot_ranks: jax.Array,  # i32[S]
    meta: TileMetadata,
    *,
    n_slices: int,
    tm: int,
    bk: int,
    num_splits: int,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # f32[num_splits, G*tm, n*rp], unscaled; rows of empty tiles undefined
    """Split-K shrink into per-split partials in tile layout."""
    in_features = x.shape[1]
    max_rank = a.shape[2] // n_slices
    rp = rank_tile(max_rank)
    blocks_per_split = cdiv(cdiv(in_features, bk), num_splits)
    grid_tiles = meta.grid_tiles
    kernel = functools.partial(
        _shrink_kernel, tm=tm, bk=bk, rp=rp, max_rank=max_rank,
        blocks_per_split=blocks_per_split, in_features=in_features,
    )
    return pl.pallas_call(
        kernel,
        grid=(grid_tiles, n_slices, num_splits),
        out_shape=jax.ShapeDtypeStruct((num_splits, grid_tiles * tm, n_slices * rp), jnp.float32),
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="lora_shrink_tiles",
    )(layer, meta.tile_slot, meta.tile_start, meta.tile_end, meta.order, slot_ranks, x, a)


def _expand_kernel(*refs, n_slices: int, tm: int, bn: int, rp: int, max_rank: int,
                   outs: tuple[int, ...], v_in_tiles: bool, num_splits: int):
    meta_refs, (scal_ref, v_ref) = refs[:6], refs[6:8]
    b_refs = refs[8 : 8 + n_slices]
    base_refs = refs[8 + n_slices : 8 + 2 * n_slices]
    y_refs = refs[8 + 2 * n_slices :]
    g, j = pl.program_id(0), pl.program_id(1)

    @pl.when(meta_refs[2][g] < meta_refs[3][g])  # tile_start < tile_end
    def _():
        t = _Tile(g, *meta_refs, tm=tm, rp=rp, max_rank=max_rank)
        tile_rows = g * tm + jnp.arange(tm, dtype=jnp.int32)
        for i in range(n_slices):

            @pl.when(j * bn < outs[i])
            def _(i=i):
                if v_in_tiles:
                    v = jnp.zeros((tm, rp), jnp.float32)
                    for s in range(num_splits):
                        v = v + plgpu.load(v_ref.at[s, tile_rows[:, None], (i * rp + t.rr)[None, :]])
                    v = v * scal_ref[t.slot]
                else:
                    vcols = i * max_rank + t.pool_rows
                    v = plgpu.load(
                        v_ref.at[t.tok[:, None], vcols[None, :]],
                        mask=jnp.broadcast_to(t.rmask[None, :], (tm, rp)), other=0,
                    )
                _expand_store(t, v, b_refs[i], base_refs[i], y_refs[i], j, bn=bn, out_features=outs[i])


def expand_add(
    v: jax.Array,  # f32[P, G*tm, n*rp] shrink partials (v_in_tiles) or f32[T, n*R] scaled v
    b: tuple[jax.Array, ...],  # n × [L, S, R, out_i]
    layer: jax.Array,  # i32[1]
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
    meta: TileMetadata,
    *,
    v_in_tiles: bool,
    tm: int,
    bn: int,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """y_i = base_i + v_i @ B_i[slot], written in place into the base outputs."""
    n_slices = len(b)
    max_rank = b[0].shape[2]
    outs = tuple(int(bi.shape[3]) for bi in b)
    num_splits = v.shape[0] if v_in_tiles else 1
    kernel = functools.partial(
        _expand_kernel, n_slices=n_slices, tm=tm, bn=bn, rp=rank_tile(max_rank), max_rank=max_rank,
        outs=outs, v_in_tiles=v_in_tiles, num_splits=num_splits,
    )
    first_base = 8 + n_slices
    return tuple(pl.pallas_call(
        kernel,
        grid=(meta.grid_tiles, max(cdiv(o, bn) for o in outs)),
        out_shape=tuple(jax.ShapeDtypeStruct(y.shape, y.dtype) for y in base_outputs),
        input_output_aliases={first_base + i: i for i in range(n_slices)},
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="lora_expand_tiles",
    )(layer, meta.tile_slot, meta.tile_start, meta.tile_end, meta.order, slot_ranks, slot_scalings, v,
      *b, *base_outputs))


def _lora_kernel(*refs, n_slices: int, tm: int, bk: int, bn: int, rp: int, max_rank: int,
                 outs: tuple[int, ...], in_features: int):
    meta_refs, (scal_ref, x_ref, a_ref) = refs[:6], refs[6:9]
    b_refs = refs[9 : 9 + n_slices]
    base_refs = refs[9 + n_slices : 9 + 2 * n_slices]
    y_refs = refs[9 + 2 * n_slices :]
    g, j = pl.program_id(0), pl.program_id(1)

    @pl.when(meta_refs[2][g] < meta_refs[3][g])  # tile_start < tile_end
    def _():
        t = _Tile(g, *meta_refs, tm=tm, rp=rp, max_rank=max_rank)
        for i in range(n_slices):

            @pl.when(j * bn < outs[i])
            def _(i=i):
                v = _shrink_blocks(t, x_ref, a_ref, i, 0, cdiv(in_features, bk), bk=bk, in_features=in_features)
                _expand_store(t, v * scal_ref[t.slot], b_refs[i], base_refs[i], y_refs[i], j, bn=bn,
                              out_features=outs[i])


def lora_single_launch(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [L, S, n*R, in]
    b: tuple[jax.Array, ...],  # n × [L, S, R, out_i]
    layer: jax.Array,  # i32[1]
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
    meta: TileMetadata,
    *,
    tm: int,
    bk: int,
    bn: int,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """Shrink and expand in one launch: program (tile, column block) computes its tile's
    v over the whole K, then adds v @ B[:, block]. A tile's A is read once per column block
    (from L2 after the first), in exchange for one launch and no partials round trip."""
    n_slices = len(b)
    max_rank = b[0].shape[2]
    outs = tuple(int(bi.shape[3]) for bi in b)
    kernel = functools.partial(
        _lora_kernel, n_slices=n_slices, tm=tm, bk=bk, bn=bn, rp=rank_tile(max_rank), max_rank=max_rank,
        outs=outs, in_features=x.shape[1],
    )
    first_base = 9 + n_slices
    return tuple(pl.pallas_call(
        kernel,
        grid=(meta.grid_tiles, max(cdiv(o, bn) for o in outs)),
        out_shape=tuple(jax.ShapeDtypeStruct(y.shape, y.dtype) for y in base_outputs),
        input_output_aliases={first_base + i: i for i in range(n_slices)},
        compiler_params=_compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="lora_single_launch",
    )(layer, meta.tile_slot, meta.tile_start, meta.tile_end, meta.order, slot_ranks, slot_scalings, x, a,
      *b, *base_outputs))
