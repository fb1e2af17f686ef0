"""Runs the LoRA shrink / expand / fused op on slot-sorted tiles, per platform.

The bgmv (decode) and sgmv (prefill) ops differ only in how the tile metadata is made
(sorted inside the jit vs host-given segments) and in their block sizes; both land here.
  gpu: Triton kernels (kernels.bgmv.gpu), x and y gathered/scattered inside the kernel
  tpu: Mosaic kernels (kernels.bgmv.tpu) on a padded tile-layout copy of x
A and B are stacked over layers ([L, S, ...], see kernels.common.stacked_pool) and
`layer` (i32[1]) says which layer the kernels read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.bgmv import gpu, tpu
from kernels.bgmv.tuned_block_sizes import BlockSizes
from kernels.common import TileMetadata, gather_tile_rows

KERNEL_PLATFORMS = ("gpu", "tpu")


def _check_platform(platform: str) -> None:
    if platform not in KERNEL_PLATFORMS:
        raise ValueError(f"{platform=} has no Pallas kernel; choose one of {KERNEL_PLATFORMS}")


def _token_scale(token_slots: jax.Array, slot_scalings: jax.Array) -> jax.Array:  # f32[T]
    return jnp.where(token_slots >= 0, slot_scalings[jnp.maximum(token_slots, 0)], 0.0)


def _tile_layout(
    v: jax.Array,  # f32[T, C]
    meta: TileMetadata,
    tm: int,
) -> jax.Array:  # f32[G*tm, C]
    rows = meta.grid_tiles * tm
    dest = jnp.where(meta.token_row >= 0, meta.token_row, rows)  # out of range: dropped
    return jnp.zeros((rows, v.shape[1]), v.dtype).at[dest].set(v, mode="drop")


def shrink_on_tiles(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [L, S, n*R, in]
    layer: jax.Array,  # i32[1]
    token_slots: jax.Array,  # i32[T]
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
    meta: TileMetadata,
    *,
    n_slices: int,
    platform: str,
    bs: BlockSizes,
    interpret: bool,
) -> jax.Array:  # f32[T, n*R], scaled, zero for slot -1
    """Shrink through the platform kernel, returned in token order."""
    _check_platform(platform)
    rank = a.shape[2] // n_slices
    if platform == "gpu":
        parts = gpu.shrink_partials(
            x, a, layer, slot_ranks, meta, n_slices=n_slices, tm=bs.tm, bk=bs.bk, num_splits=bs.num_splits,
            num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret,
        )
        rp = gpu.rank_tile(rank)
        v_tiles = parts.sum(0).reshape(-1, n_slices, rp)[:, :, :rank].reshape(-1, n_slices * rank)
    else:
        v_tiles = tpu.shrink(tpu.padded_rows(x, meta, bs.tm), a, layer, meta, tm=bs.tm, bk=bs.bk, interpret=interpret)
    return gather_tile_rows(v_tiles, meta.token_row) * _token_scale(token_slots, slot_scalings)[:, None]


def _tpu_expand_tiles(v_pad, b, layer, base_outputs, meta, bs, interpret):
    rank = b[0].shape[2]
    outs = []
    for i, (bi, yi) in enumerate(zip(b, base_outputs)):
        d = tpu.expand(v_pad[:, i * rank : (i + 1) * rank], bi, layer, meta, tm=bs.tm, bn=bs.bn, interpret=interpret)
        outs.append((yi.astype(jnp.float32) + gather_tile_rows(d, meta.token_row)).astype(yi.dtype))
    return tuple(outs)


def expand_on_tiles(
    v: jax.Array,  # f32[T, n*R] scaled
    b: tuple[jax.Array, ...],  # n × [L, S, R, out_i]
    layer: jax.Array,  # i32[1]
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
    meta: TileMetadata,
    *,
    platform: str,
    bs: BlockSizes,
    interpret: bool,
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """Expand through the platform kernel into the base outputs."""
    _check_platform(platform)
    if platform == "gpu":
        return gpu.expand_add(
            v.astype(jnp.float32), b, layer, base_outputs, slot_scalings, slot_ranks, meta, v_in_tiles=False,
            tm=bs.tm, bn=bs.bn, num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret,
        )
    v_pad = _tile_layout(v.astype(jnp.float32), meta, bs.tm)
    return _tpu_expand_tiles(v_pad, b, layer, base_outputs, meta, bs, interpret)


def lora_on_tiles(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [L, S, n*R, in]
    b: tuple[jax.Array, ...],  # n × [L, S, R, out_i]
    layer: jax.Array,  # i32[1]
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
    meta: TileMetadata,
    *,
    platform: str,
    bs: BlockSizes,
    interpret: bool,
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """Fused shrink + expand: the shrink's output stays in tile layout between kernels."""
    _check_platform(platform)
    if platform == "gpu" and bs.single_launch:
        return gpu.lora_single_launch(
            x, a, b, layer, base_outputs, slot_scalings, slot_ranks, meta, tm=bs.tm, bk=bs.bk, bn=bs.bn,
            num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret,
        )
    if platform == "gpu":
        parts = gpu.shrink_partials(
            x, a, layer, slot_ranks, meta, n_slices=len(b), tm=bs.tm, bk=bs.bk, num_splits=bs.num_splits,
            num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret,
        )
        return gpu.expand_add(
            parts, b, layer, base_outputs, slot_scalings, slot_ranks, meta, v_in_tiles=True,
            tm=bs.tm, bn=bs.bn, num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret,
        )
    v_pad = tpu.shrink(tpu.padded_rows(x, meta, bs.tm), a, layer, meta, tm=bs.tm, bk=bs.bk, interpret=interpret)
    v_pad = tpu.scale_rows(v_pad, slot_scalings, meta, bs.tm)
    return _tpu_expand_tiles(v_pad, b, layer, base_outputs, meta, bs, interpret)
