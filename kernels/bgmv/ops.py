"""BGMV: per-token LoRA for decode batches (tokens sorted by slot inside the jit).

`bgmv` is the public op (fused shrink + expand); `bgmv_shrink` and `bgmv_expand` are its
two halves for callers that need v in between. Platform dispatch: "gpu" Triton kernel,
"tpu" the Mosaic kernels of kernels.sgmv.tpu (visits of shared m-tiles, see
kernels.dispatch) or, with `BlockSizes.slot_loop`, those of kernels.bgmv.tpu (a loop over the
batch's distinct slots), "cpu" the XLA formulation measured fastest there
(kernels.xla.CPU_FORMULATION; Pallas runs on CPU only in
interpret mode: pass platform="gpu"/"tpu" with interpret=True to test a kernel there).

A and B are one layer's pool ([S, ...]) or the whole pool stacked over layers
([L, S, ...]) with `layer` (an int or a traced scalar) saying which layer to apply; the
kernels read a stacked layer in place (kernels.common.stacked_pool).
"""

from __future__ import annotations

import jax

from kernels import dispatch, xla
from kernels.bgmv.tuned_block_sizes import BlockSizes, gpu_block_sizes, tpu_block_sizes
from kernels.bgmv.validate import static_validate_expand, static_validate_inputs, static_validate_shrink
from kernels.common import default_platform, per_layer_aval, stacked_pool


def block_sizes(platform: str, num_tokens: int, in_features: int, dtype) -> BlockSizes:
    """Decode block sizes for a platform."""
    if platform == "gpu":
        return gpu_block_sizes(num_tokens, in_features, prefill=False)
    return tpu_block_sizes(dtype, prefill=False)


def _resolve(platform: str | None) -> str:
    return default_platform() if platform is None else platform


def bgmv_metadata(
    token_slots: jax.Array,  # i32[T], -1 = no adapter
    num_slots: int,
    *,
    block: BlockSizes,
    platform: str | None = None,
) -> dispatch.LoRAMetadata:
    """The slot-sorted metadata bgmv cuts on `platform` with `block` (GPU tiles, TPU visits),
    for callers that apply many projections to one batch and sort it once (`bgmv(meta=)`)."""
    return dispatch.metadata_from_slots(_resolve(platform), token_slots, num_slots, block.tm)


def bgmv_shrink(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [S, n*R, in] or [L, S, n*R, in] with layer
    token_slots: jax.Array,  # i32[T], -1 = no adapter
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
    *,
    n_slices: int,
    layer: int | jax.Array | None = None,
    platform: str | None = None,
    interpret: bool = False,
    block: BlockSizes | None = None,
) -> jax.Array:  # f32[T, n*R], scaled, zero for slot -1
    """v[t] = (x[t] @ A[slot[t]]ᵀ) * scaling[slot[t]]."""
    a, lyr = stacked_pool(a, layer)
    static_validate_shrink(x, per_layer_aval(a), n_slices, token_slots, slot_scalings, slot_ranks)
    num_slots = a.shape[1]
    platform = _resolve(platform)
    if platform == "cpu":
        return xla.shrink(x, a, token_slots, slot_scalings,
                          xla.CPU_FORMULATION, layer=lyr)
    bs = block or block_sizes(platform, x.shape[0], x.shape[1], x.dtype)
    if platform == "tpu" and bs.slot_loop:
        return dispatch.slot_loop_shrink(x, a, lyr, token_slots, slot_scalings, bs=bs, interpret=interpret)
    meta = dispatch.metadata_from_slots(platform, token_slots, num_slots, bs.tm)
    return dispatch.shrink(
        x, a, lyr, token_slots, slot_scalings, slot_ranks, meta,
        n_slices=n_slices, platform=platform, bs=bs, interpret=interpret,
    )


def bgmv_expand(
    v: jax.Array,  # f32[T, n*R] scaled
    b: tuple[jax.Array, ...],  # n × [S, R, out_i] or [L, S, R, out_i] with layer
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    token_slots: jax.Array,  # i32[T]
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
    *,
    layer: int | jax.Array | None = None,
    platform: str | None = None,
    interpret: bool = False,
    block: BlockSizes | None = None,
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """y_i[t] = base_i[t] + v[t, i*R:(i+1)*R] @ B_i[slot[t]]; unchanged for slot -1."""
    b, lyr = stacked_pool(tuple(b), layer)
    static_validate_expand(v, tuple(map(per_layer_aval, b)), base_outputs, token_slots, slot_scalings, slot_ranks)
    num_slots = b[0].shape[1]
    platform = _resolve(platform)
    if platform == "cpu":
        return xla.expand(v, b, base_outputs, token_slots, xla.CPU_FORMULATION, layer=lyr)
    bs = block or block_sizes(platform, v.shape[0], b[0].shape[3], b[0].dtype)
    if platform == "tpu" and bs.slot_loop:
        return dispatch.slot_loop_expand(v, b, lyr, base_outputs, token_slots, bs=bs, interpret=interpret)
    meta = dispatch.metadata_from_slots(platform, token_slots, num_slots, bs.tm)
    return dispatch.expand(
        v, b, lyr, base_outputs, slot_scalings, slot_ranks, meta, platform=platform, bs=bs, interpret=interpret,
    )


def bgmv(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [S, n*R, in] or [L, S, n*R, in] with layer
    b: tuple[jax.Array, ...],  # n × [S, R, out_i] or [L, S, R, out_i] with layer
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    token_slots: jax.Array,  # i32[T], -1 = no adapter
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
    *,
    layer: int | jax.Array | None = None,
    platform: str | None = None,
    interpret: bool = False,
    block: BlockSizes | None = None,
    meta: dispatch.LoRAMetadata | None = None,
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """y_i[t] = base_i[t] + scaling[s] * (x[t] @ A_i[s]ᵀ) @ B_i[s], s = slot[t] (fused).

    `meta`: `bgmv_metadata(token_slots, S, block=block, platform=platform)`, for callers that
    apply many projections to one batch and sort it once (needs `block`).
    """
    (a, *b), lyr = stacked_pool((a, *b), layer)
    b = tuple(b)
    static_validate_inputs(
        x, per_layer_aval(a), tuple(map(per_layer_aval, b)), base_outputs, token_slots, slot_scalings, slot_ranks
    )
    num_slots = a.shape[1]
    platform = _resolve(platform)
    if platform == "cpu":
        return xla.lora(x, a, b, base_outputs, token_slots, slot_scalings,
                        xla.CPU_FORMULATION, layer=lyr)
    if meta is not None and block is None:
        raise ValueError("meta was given without the block sizes it was cut with (block=None)")
    bs = block or block_sizes(platform, x.shape[0], x.shape[1], x.dtype)
    if platform == "tpu" and bs.slot_loop:  # walks the batch's slots: no metadata to cut
        return dispatch.slot_loop_lora(x, a, b, lyr, base_outputs, token_slots, slot_scalings, bs=bs,
                                       interpret=interpret)
    if meta is None:
        meta = dispatch.metadata_from_slots(platform, token_slots, num_slots, bs.tm)
    return dispatch.lora(
        x, a, b, lyr, base_outputs, token_slots, slot_scalings, slot_ranks, meta,
        platform=platform, bs=bs, interpret=interpret,
    )
