"""SGMV: LoRA for prefill batches, tokens of one adapter contiguous after sorting.

`sgmv` is the public op (fused); `sgmv_shrink` and `sgmv_expand` are its two halves.

Takes the host-computed segments of LoRABatchInfo (sorted_order, segment_starts,
segment_slots). "tpu": megablox-style grouped kernels (kernels.sgmv.tpu); "gpu": the
Triton tile kernels of kernels.bgmv.gpu on tiles cut from the segments; "cpu": the XLA
formulation measured fastest there (kernels.xla.CPU_FORMULATION).
A and B may be stacked over layers with `layer` saying which (as for bgmv).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels import dispatch, xla
from kernels.bgmv.tuned_block_sizes import BlockSizes
from kernels.bgmv.validate import static_validate_expand, static_validate_inputs, static_validate_shrink
from kernels.common import (
    default_platform, gather_tile_rows, per_layer_aval, stacked_pool, tiles_from_segments,
)
from kernels.sgmv import tpu
from kernels.sgmv.metadata import group_metadata
from kernels.sgmv.tuned_block_sizes import block_sizes
from kernels.sgmv.validate import static_validate_segments


def _setup(platform, x_shape, a_or_b_dtype, in_features, block):
    platform = default_platform() if platform is None else platform
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"{platform=} is not one of ('cpu', 'gpu', 'tpu')")
    bs = None if platform == "cpu" else (block or block_sizes(platform, x_shape[0], in_features, a_or_b_dtype))
    return platform, bs


def _sorted_scale(token_slots, slot_scalings, meta, rows):  # f32[rows] scaling of each sorted row
    sorted_slots = token_slots[meta.order[jnp.minimum(jnp.arange(rows), token_slots.shape[0] - 1)]]
    return jnp.where(sorted_slots >= 0, slot_scalings[jnp.maximum(sorted_slots, 0)], 0.0)


def _tpu_expand(v_sorted, b, layer, base_outputs, meta, bs, interpret):
    rank = b[0].shape[2]
    outs = []
    for i, (bi, yi) in enumerate(zip(b, base_outputs)):
        d = tpu.expand(v_sorted[:, i * rank : (i + 1) * rank], bi, layer, meta, tm=bs.tm, bn=bs.bn,
                       interpret=interpret)
        outs.append((yi.astype(jnp.float32) + gather_tile_rows(d, meta.token_row)).astype(yi.dtype))
    return tuple(outs)


def sgmv_shrink(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [S, n*R, in] or [L, S, n*R, in] with layer
    token_slots: jax.Array,  # i32[T], -1 = no adapter
    sorted_order: jax.Array,  # i32[T]
    segment_starts: jax.Array,  # i32[N+1]
    segment_slots: jax.Array,  # i32[N]
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
    *,
    n_slices: int,
    layer: int | jax.Array | None = None,
    platform: str | None = None,
    interpret: bool = False,
    block: BlockSizes | None = None,
) -> jax.Array:  # f32[T, n*R], scaled, zero for slot -1
    """v[t] = (x[t] @ A[slot[t]]ᵀ) * scaling[slot[t]] over slot segments."""
    a, lyr = stacked_pool(a, layer)
    static_validate_shrink(x, per_layer_aval(a), n_slices, token_slots, slot_scalings, slot_ranks)
    static_validate_segments(token_slots, sorted_order, segment_starts, segment_slots)
    platform, bs = _setup(platform, x.shape, x.dtype, x.shape[1], block)
    num_slots = a.shape[1]
    if platform == "cpu":
        return xla.shrink(x, a, token_slots, slot_scalings,
                          xla.CPU_FORMULATION, segment_slots, layer=lyr)  # the segments list the distinct slots
    if platform == "gpu":
        meta = tiles_from_segments(sorted_order, segment_starts, segment_slots, num_slots, bs.tm)
        return dispatch.shrink_on_tiles(
            x, a, lyr, token_slots, slot_scalings, slot_ranks, meta,
            n_slices=n_slices, platform=platform, bs=bs, interpret=interpret,
        )
    meta = group_metadata(sorted_order, segment_starts, segment_slots, num_slots, bs.tm)
    v = tpu.shrink(tpu.sorted_rows(x, meta, bs.tm), a, lyr, meta, tm=bs.tm, bk=bs.bk, interpret=interpret)
    v = gather_tile_rows(v, meta.token_row)
    return v * jnp.where(token_slots >= 0, slot_scalings[jnp.maximum(token_slots, 0)], 0.0)[:, None]


def sgmv_expand(
    v: jax.Array,  # f32[T, n*R] scaled
    b: tuple[jax.Array, ...],  # n × [S, R, out_i] or [L, S, R, out_i] with layer
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    token_slots: jax.Array,  # i32[T]
    sorted_order: jax.Array,  # i32[T]
    segment_starts: jax.Array,  # i32[N+1]
    segment_slots: jax.Array,  # i32[N]
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
    *,
    layer: int | jax.Array | None = None,
    platform: str | None = None,
    interpret: bool = False,
    block: BlockSizes | None = None,
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """y_i[t] = base_i[t] + v[t, i*R:(i+1)*R] @ B_i[slot[t]] over slot segments."""
    b, lyr = stacked_pool(tuple(b), layer)
    static_validate_expand(v, tuple(map(per_layer_aval, b)), base_outputs, token_slots, slot_scalings, slot_ranks)
    static_validate_segments(token_slots, sorted_order, segment_starts, segment_slots)
    platform, bs = _setup(platform, v.shape, b[0].dtype, b[0].shape[3], block)
    num_slots = b[0].shape[1]
    if platform == "cpu":
        return xla.expand(v, b, base_outputs, token_slots,
                          xla.CPU_FORMULATION, segment_slots, layer=lyr)  # the segments list the distinct slots
    if platform == "gpu":
        meta = tiles_from_segments(sorted_order, segment_starts, segment_slots, num_slots, bs.tm)
        return dispatch.expand_on_tiles(
            v, b, lyr, base_outputs, slot_scalings, slot_ranks, meta, platform=platform, bs=bs, interpret=interpret,
        )
    meta = group_metadata(sorted_order, segment_starts, segment_slots, num_slots, bs.tm)
    v_sorted = tpu.sorted_rows(v.astype(jnp.float32), meta, bs.tm)
    return _tpu_expand(v_sorted, b, lyr, base_outputs, meta, bs, interpret)


def sgmv(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [S, n*R, in] or [L, S, n*R, in] with layer
    b: tuple[jax.Array, ...],  # n × [S, R, out_i] or [L, S, R, out_i] with layer
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    token_slots: jax.Array,  # i32[T], -1 = no adapter
    sorted_order: jax.Array,  # i32[T]
    segment_starts: jax.Array,  # i32[N+1]
    segment_slots: jax.Array,  # i32[N]
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
    *,
    layer: int | jax.Array | None = None,
    platform: str | None = None,
    interpret: bool = False,
    block: BlockSizes | None = None,
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """y_i[t] = base_i[t] + scaling[s] * (x[t] @ A_i[s]ᵀ) @ B_i[s] over slot segments (fused)."""
    (a, *b), lyr = stacked_pool((a, *b), layer)
    b = tuple(b)
    static_validate_inputs(
        x, per_layer_aval(a), tuple(map(per_layer_aval, b)), base_outputs, token_slots, slot_scalings, slot_ranks
    )
    static_validate_segments(token_slots, sorted_order, segment_starts, segment_slots)
    platform, bs = _setup(platform, x.shape, x.dtype, x.shape[1], block)
    num_slots = a.shape[1]
    if platform == "cpu":
        return xla.lora(x, a, b, base_outputs, token_slots, slot_scalings,
                        xla.CPU_FORMULATION, segment_slots, layer=lyr)  # the segments list the distinct slots
    if platform == "gpu":
        meta = tiles_from_segments(sorted_order, segment_starts, segment_slots, num_slots, bs.tm)
        return dispatch.lora_on_tiles(
            x, a, b, lyr, base_outputs, slot_scalings, slot_ranks, meta, platform=platform, bs=bs, interpret=interpret,
        )
    meta = group_metadata(sorted_order, segment_starts, segment_slots, num_slots, bs.tm)
    v = tpu.shrink(tpu.sorted_rows(x, meta, bs.tm), a, lyr, meta, tm=bs.tm, bk=bs.bk, interpret=interpret)
    v = v * _sorted_scale(token_slots, slot_scalings, meta, v.shape[0])[:, None]
    return _tpu_expand(v, b, lyr, base_outputs, meta, bs, interpret)
