"""Paged attention, dispatched per platform.

  xla: chunks of pages with an online softmax (xla.py); any platform, the CPU default
  tpu: the Mosaic kernel (tpu.py), every query count and window
  gpu: JAX's Triton paged decode kernel (gpu.py) for one query per group without a
       window; chunks of several queries (prefill over a cached prefix) and sliding
       windows take the XLA formulation
"""

from __future__ import annotations

import jax

from kernels.paged_attention.gpu import gpu_paged_attention
from kernels.paged_attention.tpu import tpu_paged_attention
from kernels.paged_attention.xla import xla_paged_attention

ATTENTION_PLATFORMS = ("xla", "gpu", "tpu")


def paged_attention(
    q: jax.Array,  # [Q, C, Hq, D]: C queries of each of Q groups
    k_pages: jax.Array,  # [Hkv, N, bs, D]
    v_pages: jax.Array,  # [Hkv, N, bs, D]
    block_tables: jax.Array,  # i32[Q, P]: each group's pages in position order
    q_start: jax.Array,  # i32[Q]: position of each group's first query
    *,
    sm_scale: float | None = None,
    window: int | None = None,
    platform: str = "xla",
    interpret: bool = False,
) -> jax.Array:  # [Q, C, Hq, D]
    """Query c of group g (position q_start[g] + c) attends to its group's keys at positions
    <= its own (within `window`); see ref.py."""
    if platform not in ATTENTION_PLATFORMS:
        raise ValueError(f"{platform=} is not one of {ATTENTION_PLATFORMS}")
    args = (q, k_pages, v_pages, block_tables, q_start)
    if platform == "tpu":
        return tpu_paged_attention(*args, sm_scale=sm_scale, window=window, interpret=interpret)
    if platform == "gpu" and q.shape[1] == 1 and window is None:
        return gpu_paged_attention(*args, sm_scale=sm_scale, interpret=interpret)
    return xla_paged_attention(*args, sm_scale=sm_scale, window=window)
