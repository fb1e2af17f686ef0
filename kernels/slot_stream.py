"""The TPU LoRA kernels' own DMAs of adapter weights out of a pool left in HBM.

A pool operand given to a Mosaic kernel through a BlockSpec may be placed anywhere by XLA,
and XLA stages a pool that fits into the chip's faster memory before every call: on TPU v5e
an 8-layer decode step spent 880 us a step waiting on those copies, each of the whole stacked
pool (every layer and slot, sliced in four and concatenated) inside the layer loop. So the kernels take the pool
constrained to HBM (`in_hbm`) and fetch only the blocks their grid steps use,
double-buffered: the next block's DMA starts before this step's matmul.

A kernel's grid walks `passes` column passes (outer) of `G` steps (inner). Step g of the
first `n` uses the pool block of slot `step_slot[g]`; steps g >= n do nothing. Consecutive
steps of one slot share one fetch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

HBM = pltpu.MemorySpace.HBM


def fetch_plan(
    step_slot: jax.Array,  # i32[G] slot of each grid step
    num_steps: jax.Array,  # i32[] steps that do work (the first n)
) -> tuple[jax.Array, jax.Array, jax.Array]:  # new i32[G], index i32[G], counts i32[2]
    """Which steps fetch a new block (`new`), which fetch of a pass holds each step's block
    (`index`), and (n, fetches per pass) as `counts`; scalar-prefetch operands."""
    g = jnp.arange(step_slot.shape[0], dtype=jnp.int32)
    prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), step_slot[:-1].astype(jnp.int32)])
    new = (g < num_steps) & ((g == 0) | (step_slot != prev))
    index = jnp.cumsum(new.astype(jnp.int32)) - 1
    counts = jnp.stack([num_steps.astype(jnp.int32), jnp.sum(new, dtype=jnp.int32)])
    return new.astype(jnp.int32), index.astype(jnp.int32), counts


# Mosaic's default scoped VMEM on TPU v5e (later chips allow more): a kernel whose buffers
# need more asks for it, so that wide adapters (rank 128 of a 14336-wide down_proj in a
# prefill: 15 MiB of buffers) still compile.
DEFAULT_SCOPED_VMEM = 16 << 20
VMEM_HEADROOM = 4 << 20  # Mosaic's internal scratch and a step's temporaries


def _params(dimension_semantics: tuple[str, ...], buffer_bytes: int) -> pltpu.CompilerParams:
    """Mosaic parameters, with a VMEM limit when the kernel's buffers (`buffer_bytes`: every
    double buffer, pipelined or its own) and the headroom pass the default."""
    need = buffer_bytes + VMEM_HEADROOM
    return pltpu.CompilerParams(dimension_semantics=dimension_semantics,
                                vmem_limit_bytes=need if need > DEFAULT_SCOPED_VMEM else None)


def shrink_params(tm: int, x: jax.Array, pool: jax.Array) -> pltpu.CompilerParams:
    """A shrink's parameters (grid over tiles): x blocks [tm, in], the pool's [rows, in]
    blocks, f32 output blocks [tm, rows]."""
    rows, in_features = pool.shape[-2:]
    return _params(("arbitrary",), 2 * (tm * in_features * x.dtype.itemsize
                                        + rows * in_features * pool.dtype.itemsize + tm * rows * 4))


def expand_params(tm: int, bn: int, pool: jax.Array) -> pltpu.CompilerParams:
    """An expand's parameters (grid over column passes, then tiles): f32 v blocks [tm, R],
    the pool's [R, bn] blocks, f32 output blocks [tm, bn]."""
    rank = pool.shape[-2]
    return _params(("arbitrary", "arbitrary"), 2 * (tm * rank * 4 + rank * bn * pool.dtype.itemsize + tm * bn * 4))


def in_hbm(pool: jax.Array) -> jax.Array:
    """The pool as a kernel operand that XLA must leave in HBM (the operand's memory space
    travels in the custom call's config; a BlockSpec's memory space alone does not reach XLA).
    Only under a trace: the constraint cannot run eagerly, and an eager kernel call is a program
    of its own, with no layer loop to stage the pool in."""
    if not isinstance(pool, jax.core.Tracer):
        return pool
    return pltpu.with_memory_space_constraint(pool, HBM)


def scratch(rows: int, cols: int, dtype) -> list:
    """The VMEM double buffer and its two DMA semaphores, for `scratch_shapes`."""
    return [pltpu.VMEM((2, rows, cols), dtype), pltpu.SemaphoreType.DMA((2,))]


@dataclasses.dataclass(frozen=True)
class SlotStream:
    """Inside a kernel: the pool block of each step, fetched from HBM ahead of its use.

    pool: HBM ref [L, S, rows, width]; buf: VMEM [2, rows, cols] (cols = width, or the
    column block when `passes` > 1); the scalar refs are fetch_plan's and the layer's.
    """

    pool: object
    buf: object
    sem: object
    layer: object  # i32[1]
    slot: object  # i32[G]
    new: object  # i32[G]
    index: object  # i32[G]
    counts: object  # i32[2]
    steps: int  # G
    passes: int = 1

    def _copy(self, j, g):
        k = j * self.counts[1] + self.index[g]
        b = k % 2
        src = self.pool.at[self.layer[0], self.slot[g]]
        if self.passes > 1:
            cols = self.buf.shape[2]
            src = src.at[:, pl.ds(pl.multiple_of(j * cols, cols), cols)]
        return pltpu.make_async_copy(src, self.buf.at[b], self.sem.at[b]), b

    def active(self, g) -> jax.Array:
        """Whether step g does work."""
        return g < self.counts[0]

    def block(self, j, g):
        """Step (j, g)'s block, a VMEM ref [rows, cols]; call only where `active(g)`. Starts
        the next fetch of the walk before waiting on this step's."""
        n = self.counts[0]

        @pl.when((j == 0) & (g == 0))
        def _():
            self._copy(0, 0)[0].start()

        nxt = jnp.minimum(g + 1, self.steps - 1)

        @pl.when((g + 1 < n) & (self.new[nxt] == 1))
        def _():
            self._copy(j, nxt)[0].start()

        if self.passes > 1:
            @pl.when((g + 1 >= n) & (j + 1 < self.passes))
            def _():
                self._copy(j + 1, 0)[0].start()

        copy, b = self._copy(j, g)

        @pl.when(self.new[g] == 1)
        def _():
            copy.wait()

        return self.buf.at[b]
