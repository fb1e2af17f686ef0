"""Writing a step's new K or V into the paged cache, per platform.

  xla: one scatter of (kv head, slot) index pairs, the cache's two leading dims, so XLA
       updates the donated cache in place (any platform)
  tpu: a Mosaic kernel, one grid step per token over the sub-block of sublane-tile rows
       ([Hkv, 16, D] in bfloat16) that holds the token's slot: the block is read once, the
       row set, the block written back; consecutive tokens in one sub-block (a prefill's
       run of positions) share one read and one write. A scatter on the TPU updates its
       indices one at a time, which costs more than the DMAs of these small blocks
       (benchmarks/kv_write.py measures both).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.common import sublane_rows

WRITE_PLATFORMS = ("xla", "tpu")


def xla_write_pages(
    pages: jax.Array,  # [Hkv, N, bs, D]
    new: jax.Array,  # [T, Hkv, D]
    slots: jax.Array,  # i32[T]: block * bs + offset; outside [0, N * bs): not written
) -> jax.Array:  # pages with the new rows
    heads, n, bs, d = pages.shape
    head_ids = jnp.arange(heads, dtype=jnp.int32)[None, :]  # [1, Hkv] against slots [T, 1]
    flat = pages.reshape(heads, n * bs, d)
    flat = flat.at[head_ids, slots[:, None]].set(new.astype(pages.dtype), mode="drop")
    return flat.reshape(pages.shape)


def _write_kernel(sub_ref, row_ref, new_ref, pages_ref, out_ref):
    i = pl.program_id(0)
    # The output block stays in VMEM while consecutive tokens share it; the input block is
    # fetched once for them, so only the first of a run copies it.
    first = (i == 0) | (sub_ref[i] != sub_ref[jnp.maximum(i - 1, 0)])

    @pl.when(first)
    def _():
        out_ref[...] = pages_ref[...]

    @pl.when(row_ref[i] >= 0)
    def _():
        rows = jax.lax.broadcasted_iota(jnp.int32, out_ref.shape, 1)  # [Hkv, R, D]
        # The select runs in f32: v5e's vector unit has no 16-bit arithmetic.
        new = new_ref[...].astype(jnp.float32)[:, None, :]
        out_ref[...] = jnp.where(rows == row_ref[i], new, out_ref[...].astype(jnp.float32)).astype(out_ref.dtype)


def tpu_write_pages(
    pages: jax.Array,  # [Hkv, N, bs, D], donated by the caller's step
    new: jax.Array,  # [T, Hkv, D]
    slots: jax.Array,  # i32[T]
    *,
    interpret: bool = False,
) -> jax.Array:
    """The Mosaic write. Tokens writing one sub-block must be consecutive (a sequence's
    positions are; two sequences never share a block they write), since a sub-block left and
    visited again could be fetched before its first write-back lands."""
    heads, n, bs, d = pages.shape
    r = sublane_rows(pages.dtype)
    if bs % r:
        raise ValueError(f"block size {bs} is not a multiple of the {r}-row sublane tile of {pages.dtype}")
    t = slots.shape[0]
    view = pages.reshape(heads, n * bs // r, r, d)
    valid = (slots >= 0) & (slots < n * bs)
    # A dropped token stays on the previous token's sub-block (no DMA), the first ones on block 0.
    last_valid = jax.lax.cummax(jnp.where(valid, jnp.arange(t, dtype=jnp.int32), -1), axis=0)
    sub = jnp.where(last_valid >= 0, slots[jnp.maximum(last_valid, 0)] // r, 0).astype(jnp.int32)
    row = jnp.where(valid, slots % r, -1).astype(jnp.int32)
    block = pl.BlockSpec((heads, None, r, d), lambda i, sub_ref, row_ref: (0, sub_ref[i], 0, 0))
    out = pl.pallas_call(
        _write_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(t,),
            in_specs=[pl.BlockSpec((None, heads, d), lambda i, sub_ref, row_ref: (i, 0, 0)), block],
            out_specs=block,
        ),
        out_shape=jax.ShapeDtypeStruct(view.shape, view.dtype),
        input_output_aliases={3: 0},  # (sub, row, new, view): the cache is updated in place
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="kv_write",
    )(sub, row, new.astype(pages.dtype), view)
    return out.reshape(pages.shape)


def write_pages(pages, new, slots, *, platform: str = "xla", interpret: bool = False) -> jax.Array:
    """Writes each token's row of `new` at its slot of `pages` (see the module docstring). On
    "tpu" a block size that is not whole sublane tiles (the TPU default of 128 is) takes the
    XLA scatter."""
    if platform not in WRITE_PLATFORMS:
        raise ValueError(f"{platform=} is not one of {WRITE_PLATFORMS}")
    if platform == "tpu" and pages.shape[2] % sublane_rows(pages.dtype) == 0:
        return tpu_write_pages(pages, new, slots, interpret=interpret)
    return xla_write_pages(pages, new, slots)
