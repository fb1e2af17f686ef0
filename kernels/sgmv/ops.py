"""SGMV: LoRA for prefill batches, tokens of one adapter contiguous after sorting.

`sgmv` is the public op (fused); `sgmv_shrink` and `sgmv_expand` are its two halves.

Takes the host-computed segments of LoRABatchInfo (sorted_order, segment_starts,
segment_slots). "tpu": megablox-style grouped kernels (kernels.sgmv.tpu), or with
`BlockSizes.slot_loop` the kernels of kernels.bgmv.tpu with the rows in tiles of `tm`, each tile
walking its own distinct slots (no sort, no gather; the segments unused); "gpu": the
Triton tile kernels of kernels.bgmv.gpu on tiles cut from the segments (kernels.dispatch); "cpu": the XLA
formulation measured fastest there (kernels.xla.CPU_FORMULATION).
A and B may be stacked over layers with `layer` saying which (as for bgmv).
"""

from __future__ import annotations

import jax

from kernels import dispatch, xla
from kernels.bgmv.tuned_block_sizes import BlockSizes
from kernels.bgmv.validate import static_validate_expand, static_validate_inputs, static_validate_shrink
from kernels.common import default_platform, per_layer_aval, stacked_pool
from kernels.sgmv.tuned_block_sizes import block_sizes
from kernels.sgmv.validate import static_validate_segments


def _setup(platform, x_shape, a_or_b_dtype, in_features, block):
    platform = default_platform() if platform is None else platform
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"{platform=} is not one of ('cpu', 'gpu', 'tpu')")
    bs = None if platform == "cpu" else (block or block_sizes(platform, x_shape[0], in_features, a_or_b_dtype))
    return platform, bs


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
    if platform == "tpu" and bs.slot_loop:
        return dispatch.slot_loop_shrink(x, a, lyr, token_slots, slot_scalings, bs=bs, interpret=interpret, tm=bs.tm)
    meta = dispatch.metadata(platform, sorted_order, segment_starts, segment_slots, num_slots, bs.tm)
    return dispatch.shrink(
        x, a, lyr, token_slots, slot_scalings, slot_ranks, meta,
        n_slices=n_slices, platform=platform, bs=bs, interpret=interpret,
    )


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
    if platform == "tpu" and bs.slot_loop:
        return dispatch.slot_loop_expand(v, b, lyr, base_outputs, token_slots, bs=bs, interpret=interpret, tm=bs.tm)
    meta = dispatch.metadata(platform, sorted_order, segment_starts, segment_slots, num_slots, bs.tm)
    return dispatch.expand(
        v, b, lyr, base_outputs, slot_scalings, slot_ranks, meta, platform=platform, bs=bs, interpret=interpret,
    )


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
    if platform == "tpu" and bs.slot_loop:
        return dispatch.slot_loop_lora(x, a, b, lyr, base_outputs, token_slots, slot_scalings, bs=bs,
                                       interpret=interpret, tm=bs.tm)
    meta = dispatch.metadata(platform, sorted_order, segment_starts, segment_slots, num_slots, bs.tm)
    return dispatch.lora(
        x, a, b, lyr, base_outputs, token_slots, slot_scalings, slot_ranks, meta,
        platform=platform, bs=bs, interpret=interpret,
    )
