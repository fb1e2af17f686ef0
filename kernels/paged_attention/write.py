"""Writing a step's new K or V into the paged cache, per platform.

  xla: one scatter of (kv head, slot) index pairs, the cache's two leading dims, so XLA
       updates the donated cache in place (any platform)
  tpu: a Mosaic kernel over chunks of up to 64 tokens. A token's slot lies in one sub-block
       of sublane-tile rows ([Hkv, 16, D] in bfloat16) that the cache can be copied by; the
       chunk's tokens on one sub-block (a prefill's run of positions) form a run. A grid step
       starts the fetch of every run's sub-block into VMEM at once and waits for them, sets
       each token's row, then starts every write-back at once and waits: the DMAs overlap,
       where one grid step per token paid each fetch and write-back in turn. K and V go
       through one kernel. A scatter on the TPU updates its indices one at a time, which
       costs more (benchmarks/kv_write.py times both on the device).
"""

from __future__ import annotations

import functools

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
    # A negative index would count from the end: send it past the cache, where "drop" drops it.
    slots = jnp.where(slots < 0, n * bs, slots)
    flat = flat.at[head_ids, slots[:, None]].set(new.astype(pages.dtype), mode="drop")
    return flat.reshape(pages.shape)


def _write_kernel(sub_ref, lead_ref, row_ref, *refs, chunk: int, caches: int):
    """One chunk of tokens into each of `caches` caches (K and V): refs are the new rows
    [C, Hkv, D] of each, the caches as passed (unused), the caches as outputs (aliased to
    them: reads go through these, so a run continuing from the last chunk sees its write),
    the VMEM copies [C, Hkv, R, D] of each, then the read and write DMA semaphores
    [caches, C]."""
    news, outs, bufs = refs[:caches], refs[2 * caches:3 * caches], refs[3 * caches:4 * caches]
    read_sem, write_sem = refs[4 * caches:]
    base = pl.program_id(0) * chunk

    def copies(j, to_cache: bool):
        for c, (out, buf) in enumerate(zip(outs, bufs)):
            block = out.at[:, sub_ref[base + j]]
            if to_cache:
                yield pltpu.make_async_copy(buf.at[j], block, write_sem.at[c, j])
            else:
                yield pltpu.make_async_copy(block, buf.at[j], read_sem.at[c, j])

    def each_run(fn):
        """fn(j) for each run's first token j that writes (its sub-block is not -1)."""
        def body(j, carry):
            @pl.when((lead_ref[base + j] == j) & (sub_ref[base + j] >= 0))
            def _():
                fn(j)
            return carry
        jax.lax.fori_loop(0, chunk, body, 0)

    def start(to_cache):
        each_run(lambda j: [copy.start() for copy in copies(j, to_cache)])

    def wait(to_cache):
        each_run(lambda j: [copy.wait() for copy in copies(j, to_cache)])

    # Every run's sub-blocks are fetched at once, then waited for: the DMAs overlap, where one
    # grid step per token paid each fetch and write-back in turn.
    start(False)
    wait(False)

    def set_row(j, carry):
        @pl.when(row_ref[base + j] >= 0)
        def _():
            lead = lead_ref[base + j]
            for new_ref, buf in zip(news, bufs):
                rows = jax.lax.broadcasted_iota(jnp.int32, buf.shape[1:], 1)  # [Hkv, R, D]
                # The select runs in f32: v5e's vector unit has no 16-bit arithmetic.
                new = new_ref[j].astype(jnp.float32)[:, None, :]
                buf[lead] = jnp.where(rows == row_ref[base + j], new,
                                      buf[lead].astype(jnp.float32)).astype(buf.dtype)
        return carry

    jax.lax.fori_loop(0, chunk, set_row, 0)
    start(True)
    wait(True)


# VMEM a chunk's sub-blocks may take: a bfloat16 token of 8 kv heads holds a 32 KiB sub-block
# of K and one of V, so 64 tokens (a decode batch) take 4 MiB, under the 16 MiB Mosaic allows a
# kernel.
CHUNK_BUDGET = 4 << 20
MAX_CHUNK = 64


def chunk_tokens(tokens: int, sub_block_bytes: int) -> int:
    """Tokens one grid step writes: a power of two, at most MAX_CHUNK, whose sub-blocks fit
    CHUNK_BUDGET, and no more than `tokens` needs."""
    chunk = 1
    while chunk < min(tokens, MAX_CHUNK) and 2 * chunk * sub_block_bytes <= CHUNK_BUDGET:
        chunk *= 2
    return chunk


def runs(slots: jax.Array, total: int, r: int, chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token: its sub-block, the chunk-local index of its run's first token, its row.

    A run is the chunk's tokens on one sub-block (a prefill's consecutive positions, or any
    tokens that share it); its first token fetches the sub-block and writes it back, and
    every token of the run sets its row in that one copy, so tokens sharing a sub-block need
    not be adjacent. A dropped token (slot outside [0, total)) has sub-block and row -1: its
    run copies nothing."""
    valid = (slots >= 0) & (slots < total)
    sub = jnp.where(valid, slots // r, -1).astype(jnp.int32)
    by_chunk = sub.reshape(-1, chunk)
    same = by_chunk[:, :, None] == by_chunk[:, None, :]  # [chunks, C, C]
    lead = jnp.argmax(same, axis=2).astype(jnp.int32).reshape(-1)  # the first token on the same sub-block
    row = jnp.where(valid, slots % r, -1).astype(jnp.int32)
    return sub, lead, row


def tpu_write_caches(
    caches: tuple[jax.Array, ...],  # each [Hkv, N, bs, D], one shape and dtype, donated by the caller
    news: tuple[jax.Array, ...],  # each [T, Hkv, D]
    slots: jax.Array,  # i32[T]
    *,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """The Mosaic write of one set of slots into each cache (K and V together: one kernel, their
    DMAs in flight at once); see the module docstring."""
    heads, n, bs, d = caches[0].shape
    dtype = caches[0].dtype
    if any(c.shape != caches[0].shape or c.dtype != dtype for c in caches):
        raise ValueError(f"caches differ: {[(c.shape, str(c.dtype)) for c in caches]}")
    r = sublane_rows(dtype)
    if bs % r:
        raise ValueError(f"block size {bs} is not a multiple of the {r}-row sublane tile of {dtype}")
    t = slots.shape[0]
    chunk = chunk_tokens(t, len(caches) * heads * r * d * jnp.dtype(dtype).itemsize)
    padded = -(-t // chunk) * chunk
    slots = slots.astype(jnp.int32)
    news = tuple(x.astype(dtype) for x in news)
    if padded != t:  # padding tokens are dropped
        slots = jnp.concatenate([slots, jnp.full((padded - t,), -1, jnp.int32)])
        news = tuple(jnp.concatenate([x, jnp.zeros((padded - t, *x.shape[1:]), dtype)]) for x in news)
    sub, lead, row = runs(slots, n * bs, r, chunk)
    views = tuple(c.reshape(heads, n * bs // r, r, d) for c in caches)
    k = len(caches)
    outs = pl.pallas_call(
        functools.partial(_write_kernel, chunk=chunk, caches=k),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(padded // chunk,),
            in_specs=([pl.BlockSpec((chunk, heads, d), lambda i, *_: (i, 0, 0))] * k
                      + [pl.BlockSpec(memory_space=pl.ANY)] * k),
            out_specs=[pl.BlockSpec(memory_space=pl.ANY)] * k,
            scratch_shapes=([pltpu.VMEM((chunk, heads, r, d), dtype)] * k
                            + [pltpu.SemaphoreType.DMA((k, chunk)), pltpu.SemaphoreType.DMA((k, chunk))]),
        ),
        out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype) for v in views],
        # (sub, lead, row, *news, *views): each cache is updated in place
        input_output_aliases={3 + k + c: c for c in range(k)},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="kv_write",
    )(sub, lead, row, *news, *views)
    return tuple(o.reshape(caches[0].shape) for o in outs)


def tpu_write_pages(pages: jax.Array, new: jax.Array, slots: jax.Array, *, interpret: bool = False) -> jax.Array:
    """tpu_write_caches into one cache."""
    return tpu_write_caches((pages,), (new,), slots, interpret=interpret)[0]


def write_pages(pages, new, slots, *, platform: str = "xla", interpret: bool = False) -> jax.Array:
    """Writes each token's row of `new` at its slot of `pages` (see the module docstring). On
    "tpu" a block size that is not whole sublane tiles (the TPU default of 128 is) takes the
    XLA scatter."""
    if _mosaic(pages, platform):
        return tpu_write_pages(pages, new, slots, interpret=interpret)
    return xla_write_pages(pages, new, slots)


def _mosaic(pages: jax.Array, platform: str) -> bool:
    """Whether `platform` writes `pages` through the Mosaic kernel."""
    if platform not in WRITE_PLATFORMS:
        raise ValueError(f"{platform=} is not one of {WRITE_PLATFORMS}")
    return platform == "tpu" and pages.shape[2] % sublane_rows(pages.dtype) == 0


def write_kv_pages(k_pages, v_pages, k, v, slots, *, platform: str = "xla",
                   interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """write_pages of K and V at the same slots; on "tpu" one kernel writes both."""
    if _mosaic(k_pages, platform):
        return tpu_write_caches((k_pages, v_pages), (k, v), slots, interpret=interpret)
    return xla_write_pages(k_pages, k, slots), xla_write_pages(v_pages, v, slots)
