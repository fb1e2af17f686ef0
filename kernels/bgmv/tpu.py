"""TPU (Mosaic) decode LoRA that walks the batch's distinct slots: one grid step, rows in place.

The visits kernels (kernels.sgmv.tpu) cut the slot-sorted rows into m-tiles and give each
(tile, slot) visit a grid step of its own. Their grid is static, so a decode batch pays for
the most visits its rows could need (a 32-row batch: 33 steps a call, 88 calls a step at 8
layers of Llama shapes), each step with a fixed cost, and one weight block in flight at a
time; sorting the rows and gathering them back are XLA ops of their own. On TPU v5e those
kernels ran at about twice their bytes (benchmarks/results/2026-12-07-tpu-v5e-serving-trace.md).

A decode batch is small enough to stay in VMEM whole. So here x [T, in] and the output sit in
VMEM for the call, and a loop over the batch's distinct slots (their count is a runtime
scalar) DMAs each slot's block of the pool in HBM, `depth` blocks in flight, multiplies the
whole batch by it (the MXU's cost for a few dozen rows is the cost for one tile) and keeps the
rows of that slot. The rows stay in token order, the loop runs as many times as there are
adapters in the batch, and the DMAs overlap each other. The expand walks column blocks of the
output (grid steps) when the whole width would not fit VMEM.

A prompt step's rows do not fit VMEM whole, and the MXU's cost grows with rows times slots. With
`tm` the rows are cut into tiles of `tm` (grid steps, x's tile pipelined by Pallas) and each
tile walks only its own distinct slots: a packed prompt's rows are contiguous, so a tile holds
one or two adapters, and nothing is sorted or gathered back (the visits kernels sort the rows
by slot and gather them back, as XLA ops of their own).

Chosen by `BlockSizes.slot_loop` (kernels.bgmv.tuned_block_sizes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.common import cdiv, mxu_dot
from kernels.sgmv.tpu import interpret_params
from kernels.slot_stream import DEFAULT_SCOPED_VMEM, HBM, VMEM_HEADROOM, in_hbm

_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))
# VMEM a call's own buffers may take before the expand splits its width into column blocks
# (a v5e core has 128 MiB; Mosaic's default scoped limit is 16 MiB and a call asks for more).
VMEM_BUDGET = 32 << 20


def distinct_slots(token_slots: jax.Array, num_slots: int) -> tuple[jax.Array, jax.Array]:
    """(slots i32[G], count i32[1]): the distinct slots (>= 0) of the tokens, ascending, in the
    first `count` entries (the rest 0, unused); G = min(num_slots, T). Only these T integers are
    sorted; the rows stay where they are."""
    return tile_slots(token_slots, num_slots, token_slots.shape[0])


def tile_slots(token_slots: jax.Array, num_slots: int, tm: int) -> tuple[jax.Array, jax.Array]:
    """distinct_slots of each tile of `tm` rows (T a multiple of tm): (slots i32[nt * G], tile i's
    in entries [i*G, i*G + count[i]); count i32[nt]), G = min(num_slots, tm)."""
    t = token_slots.shape[0]
    nt, g = t // tm, max(1, min(num_slots, tm))
    keys = jnp.sort(jnp.where(token_slots < 0, num_slots, token_slots).astype(jnp.int32).reshape(nt, tm), axis=1)
    first = (keys < num_slots) & jnp.concatenate([jnp.ones((nt, 1), bool), keys[:, 1:] != keys[:, :-1]], axis=1)
    position = jnp.where(first, jnp.cumsum(first, axis=1) - 1, g)
    tiles = jnp.broadcast_to(jnp.arange(nt)[:, None], (nt, tm))
    slots = jnp.zeros((nt, g), jnp.int32).at[tiles, position].set(keys, mode="drop")
    return slots.reshape(nt * g), jnp.sum(first, axis=1, dtype=jnp.int32)


def _walk(n, depth: int, limit: int, copy, use) -> None:
    """use(k, buffer) for k in [0, n), the DMA of block k started `depth` blocks ahead of its
    use (`copy(k)`: block k's descriptor into buffer k % depth; `limit`: the static count of
    slot entries)."""
    for d in range(min(depth, limit)):
        @pl.when(d < n)
        def _():
            copy(d).start()

    def body(k, carry):
        copy(k).wait()
        use(k, k % depth)

        @pl.when(k + depth < n)
        def _():  # block k's buffer is free once use(k) has read it
            copy(k + depth).start()

        return carry

    jax.lax.fori_loop(0, n, body, 0)


def _rows_of(tok_ref, slot, shape) -> jax.Array:
    """The rows of `slot`, as a mask of `shape`: the token slots [T, 1] are broadcast over the
    lanes as integers before the compare (a lane broadcast of a boolean vector is not one
    Mosaic is sure to lower)."""
    return jnp.broadcast_to(tok_ref[...], shape) == slot


def _shrink_kernel(slots_ref, count_ref, layer_ref, tok_ref, x_ref, a_hbm, o_ref, buf, sem, *, depth, limit):
    base = pl.program_id(0) * limit  # this row tile's slot entries

    def copy(k):
        b = k % depth
        return pltpu.make_async_copy(a_hbm.at[layer_ref[0], slots_ref[base + k]], buf.at[b], sem.at[b])

    o_ref[...] = jnp.zeros_like(o_ref)

    def use(k, b):  # x is read from VMEM each time: held across the loop it would not fit the registers
        d = mxu_dot(x_ref[...], buf[b], _NT)
        o_ref[...] = jnp.where(_rows_of(tok_ref, slots_ref[base + k], d.shape), d, o_ref[...])

    _walk(count_ref[pl.program_id(0)], depth, limit, copy, use)


def _expand_kernel(slots_ref, count_ref, layer_ref, tok_ref, v_ref, b_hbm, o_ref, buf, sem, *, depth, limit, bn,
                   out_features):
    i, j = pl.program_id(0), pl.program_id(1)
    base = i * limit

    def copy(k):
        b = k % depth
        src = b_hbm.at[layer_ref[0], slots_ref[base + k]]
        if bn != out_features:  # a column block (bn: a multiple of 128); one whole width (any) is not sliced
            src = src.at[:, pl.ds(pl.multiple_of(j * bn, 128), bn)]
        return pltpu.make_async_copy(src, buf.at[b], sem.at[b])

    o_ref[...] = jnp.zeros_like(o_ref)

    def use(k, b):
        blk = buf[b]
        d = mxu_dot(v_ref[...].astype(blk.dtype), blk, _NN)
        o_ref[...] = jnp.where(_rows_of(tok_ref, slots_ref[base + k], d.shape), d, o_ref[...])

    _walk(count_ref[i], depth, limit, copy, use)


def _launch(kernel, spec, rows: int, out_cols: int, buffer_bytes: int, interpret: bool, name: str,
            *args) -> jax.Array:
    """The kernel over `spec`'s grid, its f32 output [rows, out_cols], with a VMEM limit when its
    buffers and the headroom pass Mosaic's default."""
    need = buffer_bytes + VMEM_HEADROOM
    params = pltpu.CompilerParams(dimension_semantics=("arbitrary",) * len(spec.grid),
                                  vmem_limit_bytes=need if need > DEFAULT_SCOPED_VMEM else None)
    out_shape = jax.ShapeDtypeStruct((rows, out_cols), jnp.float32)
    return pl.pallas_call(kernel, grid_spec=spec, out_shape=out_shape, compiler_params=params,
                          interpret=interpret_params(interpret), name=name)(*args)


def _rows(x: jax.Array, token_slots: jax.Array, tm: int | None) -> tuple[jax.Array, jax.Array, int]:
    """x and the token slots (as i32[Tp, 1]) padded to whole row tiles (padded rows: no slot), and
    the tile's rows: `tm`, or None for one tile of the whole batch in sublane tiles."""
    t = x.shape[0]
    tm = tm or cdiv(t, 16) * 16
    tp = cdiv(t, tm) * tm
    tok = jnp.pad(token_slots.astype(jnp.int32), (0, tp - t), constant_values=-1)
    return jnp.pad(x, ((0, tp - t), (0, 0))), tok.reshape(tp, 1), tm


def shrink(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [L, S, n*R, in]
    layer: jax.Array,  # i32[1]
    token_slots: jax.Array,  # i32[T], -1 = no adapter
    *,
    depth: int,
    tm: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # f32[T, n*R] unscaled; zero for slot -1
    """v[t] = x[t] @ A[slot[t]]ᵀ, walking the distinct slots of each tile of `tm` rows (None: the
    whole batch one tile)."""
    t, in_features = x.shape
    nr, num_slots = a.shape[2], a.shape[1]
    xp, tok, tm = _rows(x.astype(a.dtype), token_slots, tm)
    slots, count = tile_slots(tok[:, 0], num_slots, tm)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(xp.shape[0] // tm,),
        in_specs=[pl.BlockSpec((tm, 1), lambda i, *_: (i, 0)),
                  pl.BlockSpec((tm, in_features), lambda i, *_: (i, 0)),
                  pl.BlockSpec(memory_space=HBM)],
        out_specs=pl.BlockSpec((tm, nr), lambda i, *_: (i, 0)),
        scratch_shapes=[pltpu.VMEM((depth, nr, in_features), a.dtype), pltpu.SemaphoreType.DMA((depth,))],
    )
    item = jnp.dtype(a.dtype).itemsize
    buffers = 2 * (tm * 128 * 4 + tm * in_features * item + tm * nr * 4) + depth * nr * in_features * item
    kernel = functools.partial(_shrink_kernel, depth=depth, limit=slots.shape[0] // count.shape[0])
    return _launch(kernel, spec, xp.shape[0], nr, buffers, interpret, "lora_bgmv_shrink", slots, count, layer, tok,
                   xp, in_hbm(a))[:t]


def expand_block(tp: int, rank: int, out_features: int, depth: int, itemsize: int) -> int:
    """The widest column block (a multiple of 128 dividing `out_features`, or the whole width)
    whose buffers fit VMEM_BUDGET: the f32 output block twice, `depth` weight blocks."""
    def need(bn):
        return 2 * tp * bn * 4 + depth * rank * bn * itemsize

    if need(out_features) <= VMEM_BUDGET or out_features % 128:
        return out_features
    fits = [bn for bn in range(128, out_features, 128) if out_features % bn == 0 and need(bn) <= VMEM_BUDGET]
    return max(fits, default=128)


def expand(
    v: jax.Array,  # f32[T, R] one slice, scaled
    b: jax.Array,  # [L, S, R, out]
    layer: jax.Array,  # i32[1]
    token_slots: jax.Array,  # i32[T]
    *,
    depth: int,
    tm: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # f32[T, out] delta; zero for slot -1
    """delta[t] = v[t] @ B[slot[t]], walking the distinct slots of each tile of `tm` rows (None:
    the whole batch one tile) in each column block."""
    t, rank = v.shape
    num_slots, out_features = b.shape[1], b.shape[3]
    vp, tok, tm = _rows(v.astype(jnp.float32), token_slots, tm)
    slots, count = tile_slots(tok[:, 0], num_slots, tm)
    item = jnp.dtype(b.dtype).itemsize
    bn = expand_block(tm, rank, out_features, depth, item)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(vp.shape[0] // tm, out_features // bn),
        in_specs=[pl.BlockSpec((tm, 1), lambda i, j, *_: (i, 0)),
                  pl.BlockSpec((tm, rank), lambda i, j, *_: (i, 0)),
                  pl.BlockSpec(memory_space=HBM)],
        out_specs=pl.BlockSpec((tm, bn), lambda i, j, *_: (i, j)),
        scratch_shapes=[pltpu.VMEM((depth, rank, bn), b.dtype), pltpu.SemaphoreType.DMA((depth,))],
    )
    buffers = 2 * (tm * 128 * 4 + tm * max(rank, 128) * 4 + tm * bn * 4) + depth * rank * bn * item
    kernel = functools.partial(_expand_kernel, depth=depth, limit=slots.shape[0] // count.shape[0], bn=bn,
                               out_features=out_features)
    return _launch(kernel, spec, vp.shape[0], out_features, buffers, interpret, "lora_bgmv_expand", slots, count,
                   layer, tok, vp, in_hbm(b))[:t]
