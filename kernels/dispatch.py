"""Runs the LoRA shrink / expand / fused op on slot-sorted tokens, per platform.

The bgmv (decode) and sgmv (prefill) ops differ only in where the slot-sorted segments come
from (sorted inside the jit vs the host's LoRABatchInfo) and in their block sizes; both land
here with the platform's metadata (`metadata`):
  gpu: Triton kernels (kernels.bgmv.gpu) over tiles of at most `tm` tokens of one slot
       (kernels.common.TileMetadata), x and y gathered/scattered inside the kernel
  tpu: Mosaic kernels (kernels.sgmv.tpu) over megablox-style visits of `tm`-row m-tiles of
       the slot-sorted tokens (kernels.sgmv.metadata.GroupMetadata): an m-tile holding tokens
       of several slots is visited once per slot, so a token alone on its adapter fills one
       row of a shared tile rather than a padded tile of its own. On TPU v5e, decode batches
       of 16 to 256 tokens over 8 to 256 slots ran 4-35% faster this way than through one
       padded tile per slot (benchmarks/results/2026-12-06-tpu-v5e-decode-visits.md).
A TPU batch with `BlockSizes.slot_loop` skips the metadata: kernels.bgmv.tpu walks its distinct
slots with the rows in token order, a decode batch as one tile, a prompt step's rows in tiles of
`tm` each walking its own (`slot_loop_shrink`, `slot_loop_expand`, `slot_loop_lora`).
A and B are stacked over layers ([L, S, ...], see kernels.common.stacked_pool) and
`layer` (i32[1]) says which layer the kernels read.
"""

from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp

from kernels.bgmv import gpu
from kernels.bgmv import tpu as slot_loop
from kernels.bgmv.tuned_block_sizes import BlockSizes
from kernels.common import TileMetadata, gather_tile_rows, segments_from_slots, tiles_from_segments
from kernels.sgmv import tpu
from kernels.sgmv.metadata import GroupMetadata, group_metadata

KERNEL_PLATFORMS = ("gpu", "tpu")
LoRAMetadata = Union[TileMetadata, GroupMetadata]


def _check_platform(platform: str) -> None:
    if platform not in KERNEL_PLATFORMS:
        raise ValueError(f"{platform=} has no Pallas kernel; choose one of {KERNEL_PLATFORMS}")


def metadata(
    platform: str,
    order: jax.Array,  # i32[T] sorted position -> token
    segment_starts: jax.Array,  # i32[N+1]
    segment_slots: jax.Array,  # i32[N], -1 unused (zero length)
    num_slots: int,
    tm: int,
) -> LoRAMetadata:
    """The platform kernels' metadata for slot segments: GPU tiles or TPU visits."""
    _check_platform(platform)
    if platform == "gpu":
        return tiles_from_segments(order, segment_starts, segment_slots, num_slots, tm)
    return group_metadata(order, segment_starts, segment_slots, num_slots, tm)


def metadata_from_slots(platform: str, token_slots: jax.Array, num_slots: int, tm: int) -> LoRAMetadata:
    """`metadata` for a batch sorted by slot inside the jit (decode)."""
    return metadata(platform, *segments_from_slots(token_slots, num_slots), num_slots, tm)


def _check_metadata(platform: str, meta: LoRAMetadata) -> None:
    want = TileMetadata if platform == "gpu" else GroupMetadata
    if not isinstance(meta, want):
        raise TypeError(f"the {platform} kernels take {want.__name__}, got {type(meta).__name__}")


def _token_scale(token_slots: jax.Array, slot_scalings: jax.Array) -> jax.Array:  # f32[T]
    return jnp.where(token_slots >= 0, slot_scalings[jnp.maximum(token_slots, 0)], 0.0)


def _sorted_scale(token_slots, slot_scalings, meta: GroupMetadata, rows):  # f32[rows] each sorted row's scaling
    return _token_scale(token_slots[meta.order[jnp.minimum(jnp.arange(rows), token_slots.shape[0] - 1)]],
                        slot_scalings)


def _tpu_expand(v_sorted, b, layer, base_outputs, meta: GroupMetadata, bs: BlockSizes, interpret):
    rank = b[0].shape[2]
    outs = []
    for i, (bi, yi) in enumerate(zip(b, base_outputs)):
        d = tpu.expand(v_sorted[:, i * rank : (i + 1) * rank], bi, layer, meta, tm=bs.tm, bn=bs.bn,
                       interpret=interpret)
        outs.append((yi.astype(jnp.float32) + gather_tile_rows(d, meta.token_row)).astype(yi.dtype))
    return tuple(outs)


def slot_loop_shrink(x, a, layer, token_slots, slot_scalings, *, bs: BlockSizes, interpret: bool,
                     tm: int | None = None) -> jax.Array:
    """Shrink through kernels.bgmv.tpu (rows in tiles of `tm`, None: one tile): f32[T, n*R],
    scaled, zero for slot -1."""
    v = slot_loop.shrink(x, a, layer, token_slots, depth=bs.slot_loop, tm=tm, interpret=interpret)
    return v * _token_scale(token_slots, slot_scalings)[:, None]


def slot_loop_expand(v, b, layer, base_outputs, token_slots, *, bs: BlockSizes, interpret: bool,
                     tm: int | None = None) -> tuple:
    """Expand through kernels.bgmv.tpu into the base outputs."""
    rank = b[0].shape[2]
    return tuple((yi.astype(jnp.float32) + slot_loop.expand(v[:, i * rank:(i + 1) * rank], bi, layer, token_slots,
                                                            depth=bs.slot_loop, tm=tm, interpret=interpret)
                  ).astype(yi.dtype)
                 for i, (bi, yi) in enumerate(zip(b, base_outputs)))


def slot_loop_lora(x, a, b, layer, base_outputs, token_slots, slot_scalings, *, bs: BlockSizes,
                   interpret: bool, tm: int | None = None) -> tuple:
    """Fused shrink + expand through kernels.bgmv.tpu."""
    v = slot_loop_shrink(x, a, layer, token_slots, slot_scalings, bs=bs, interpret=interpret, tm=tm)
    return slot_loop_expand(v, b, layer, base_outputs, token_slots, bs=bs, interpret=interpret, tm=tm)


def shrink(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [L, S, n*R, in]
    layer: jax.Array,  # i32[1]
    token_slots: jax.Array,  # i32[T]
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
    meta: LoRAMetadata,
    *,
    n_slices: int,
    platform: str,
    bs: BlockSizes,
    interpret: bool,
) -> jax.Array:  # f32[T, n*R], scaled, zero for slot -1
    """Shrink through the platform kernel, returned in token order."""
    _check_platform(platform)
    _check_metadata(platform, meta)
    rank = a.shape[2] // n_slices
    if platform == "gpu":
        parts = gpu.shrink_partials(
            x, a, layer, slot_ranks, meta, n_slices=n_slices, tm=bs.tm, bk=bs.bk, num_splits=bs.num_splits,
            num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret,
        )
        rp = gpu.rank_tile(rank)
        v = parts.sum(0).reshape(-1, n_slices, rp)[:, :, :rank].reshape(-1, n_slices * rank)
    else:
        v = tpu.shrink(tpu.sorted_rows(x, meta, bs.tm), a, layer, meta, tm=bs.tm, bk=bs.bk, interpret=interpret)
    return gather_tile_rows(v, meta.token_row) * _token_scale(token_slots, slot_scalings)[:, None]


def expand(
    v: jax.Array,  # f32[T, n*R] scaled
    b: tuple[jax.Array, ...],  # n × [L, S, R, out_i]
    layer: jax.Array,  # i32[1]
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
    meta: LoRAMetadata,
    *,
    platform: str,
    bs: BlockSizes,
    interpret: bool,
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """Expand through the platform kernel into the base outputs."""
    _check_platform(platform)
    _check_metadata(platform, meta)
    if platform == "gpu":
        return gpu.expand_add(
            v.astype(jnp.float32), b, layer, base_outputs, slot_scalings, slot_ranks, meta, v_in_tiles=False,
            tm=bs.tm, bn=bs.bn, num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret,
        )
    return _tpu_expand(tpu.sorted_rows(v.astype(jnp.float32), meta, bs.tm), b, layer, base_outputs, meta, bs,
                       interpret)


def lora(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [L, S, n*R, in]
    b: tuple[jax.Array, ...],  # n × [L, S, R, out_i]
    layer: jax.Array,  # i32[1]
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    token_slots: jax.Array,  # i32[T]
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
    meta: LoRAMetadata,
    *,
    platform: str,
    bs: BlockSizes,
    interpret: bool,
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """Fused shrink + expand: the shrink's output stays in the kernels' row layout between them."""
    _check_platform(platform)
    _check_metadata(platform, meta)
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
    v = tpu.shrink(tpu.sorted_rows(x, meta, bs.tm), a, layer, meta, tm=bs.tm, bk=bs.bk, interpret=interpret)
    v = v * _sorted_scale(token_slots, slot_scalings, meta, v.shape[0])[:, None]
    return _tpu_expand(v, b, layer, base_outputs, meta, bs, interpret)
