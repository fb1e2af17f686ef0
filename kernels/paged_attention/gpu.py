"""Paged decode attention on GPU: JAX's Pallas (Triton) paged-attention kernel.

It takes one query per sequence and no sliding window, over the same [Hkv, N, bs, D]
pages as every formulation here; it splits each sequence's pages into `k_splits`
partitions of whole compute blocks, so the block table is padded (with the null page)
to a multiple of both. The kernel has no softmax scale: queries are scaled before.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import paged_attention as triton_paged

from kernels.paged_attention.validate import static_validate_inputs

BLOCK_H = 16  # query heads per kv head are padded to this (the kernel's minimum)
PAGES_PER_COMPUTE_BLOCK = 8
MAX_K_SPLITS = 16


def split_sizes(pages: int) -> tuple[int, int]:
    """(pages per compute block, k_splits) for a block table of `pages` entries."""
    per_block = min(PAGES_PER_COMPUTE_BLOCK, pages)
    return per_block, max(1, min(MAX_K_SPLITS, -(-pages // per_block)))


def gpu_paged_attention(
    q: jax.Array,  # [Q, 1, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, bs, D]
    v_pages: jax.Array,  # [Hkv, N, bs, D]
    block_tables: jax.Array,  # i32[Q, P]
    q_start: jax.Array,  # i32[Q]: the query's position
    *,
    sm_scale: float | None = None,
    interpret: bool = False,
) -> jax.Array:  # [Q, 1, Hq, D]
    """Decode attention (semantics in ref.py, C = 1, no window) through the Triton kernel."""
    static_validate_inputs(q, k_pages, v_pages, block_tables, q_start, None)
    if q.shape[1] != 1:
        raise ValueError(f"the GPU paged kernel takes one query per group, got C={q.shape[1]}")
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    pages = block_tables.shape[1]
    per_block, k_splits = split_sizes(pages)
    multiple = per_block * k_splits
    if pages % multiple:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, multiple - pages % multiple)))
    queries = (q[:, 0].astype(jnp.float32) * scale).astype(q.dtype)
    out = triton_paged.paged_attention(
        queries, k_pages, v_pages, block_tables, q_start + 1,
        block_h=BLOCK_H, pages_per_compute_block=per_block, k_splits=k_splits, interpret=interpret,
    )
    return out[:, None]
