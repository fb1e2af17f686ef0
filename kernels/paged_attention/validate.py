"""Shape and dtype checks of paged attention's inputs (static: they hold under tracing)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def static_validate_inputs(
    q: jax.Array,  # [Q, C, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, bs, D]
    v_pages: jax.Array,  # [Hkv, N, bs, D]
    block_tables: jax.Array,  # i32[Q, P]
    q_start: jax.Array,  # i32[Q]
    window: int | None,
) -> None:
    """Raises ValueError naming the first argument whose shape or dtype is wrong."""
    if q.ndim != 4:
        raise ValueError(f"q must be [Q, C, Hq, D], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must both be [Hkv, N, bs, D]")
    groups, _, heads, head_dim = q.shape
    kv_heads, _, _, kv_dim = k_pages.shape
    if kv_dim != head_dim:
        raise ValueError(f"K/V head_dim {kv_dim} != q head_dim {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"q heads {heads} are not a multiple of kv heads {kv_heads}")
    if block_tables.ndim != 2 or block_tables.shape[0] != groups:
        raise ValueError(f"block_tables must be [Q={groups}, P], got shape {block_tables.shape}")
    if q_start.shape != (groups,):
        raise ValueError(f"q_start must be [Q={groups}], got shape {q_start.shape}")
    for name, arr in (("block_tables", block_tables), ("q_start", q_start)):
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {arr.dtype}")
    if window is not None and window < 1:
        raise ValueError(f"{window=} must be >= 1 or None")
