"""Megablox-style group metadata for the TPU SGMV kernels.

The slot-sorted tokens are cut into fixed m-tiles of `tm` rows (no per-segment padding).
A tile that holds tokens of several segments is *visited* once per segment; a visit
carries its tile, its slot and the sorted-row range of its segment, and the kernel masks
the rows outside that range. Visits of one tile are consecutive, so the tile's output
block stays in VMEM across them; visits of one slot are consecutive, so the slot's
weight block is DMA'd once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kernels.common import cdiv


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupMetadata:
    """Visits over m-tiles of the slot-sorted tokens (static count, tail visits repeat the last)."""

    order: jax.Array  # i32[T] sorted position -> token
    visit_tile: jax.Array  # i32[V] m-tile of each visit
    visit_slot: jax.Array  # i32[V] slot (>= 0) whose weights the visit uses
    visit_lo: jax.Array  # i32[V] first sorted row of the visit's segment
    visit_hi: jax.Array  # i32[V] one past its last sorted row (lo == hi: skip)
    token_row: jax.Array  # i32[T] token -> sorted row; -1 for no adapter
    num_visits: jax.Array  # i32[]

    @property
    def grid_visits(self) -> int:
        return self.visit_tile.shape[0]


def max_visits(num_tokens: int, num_slots: int, tm: int) -> int:
    """Each segment adds at most one visit beyond the m-tile count (`num_slots`: the most
    distinct slots the tokens can use)."""
    return cdiv(num_tokens, tm) + max(min(num_slots, num_tokens) - 1, 0)


def group_metadata(
    order: jax.Array,  # i32[T]
    segment_starts: jax.Array,  # i32[N+1]
    segment_slots: jax.Array,  # i32[N], -1 unused (zero length)
    num_slots: int,
    tm: int,
) -> GroupMetadata:
    """Visits for segments laid out contiguously in sorted order."""
    num_tokens = order.shape[0]
    lo, hi = segment_starts[:-1], segment_starts[1:]
    nonempty = hi > lo
    first_tile = lo // tm
    last_tile = (hi - 1) // tm
    seg_visits = jnp.where(nonempty, last_tile - first_tile + 1, 0).astype(jnp.int32)
    base = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(seg_visits, dtype=jnp.int32)])
    num_visits = base[-1]
    # The segments bound the distinct slots (a step's info has at most max_batch of them): a
    # pool wider than the batch adds no visits.
    num_grid = max_visits(num_tokens, min(num_slots, segment_slots.shape[0]), tm)
    last_seg = seg_visits.shape[0] - 1

    v = jnp.arange(num_grid, dtype=jnp.int32)
    # Tail visits repeat the last real visit with an empty row range.
    vr = jnp.minimum(v, jnp.maximum(num_visits - 1, 0))
    seg = jnp.minimum(jnp.searchsorted(base[1:], vr, side="right", method="compare_all"), last_seg)
    real = v < num_visits
    visit_tile = (first_tile[seg] + vr - base[seg]).astype(jnp.int32)
    visit_slot = jnp.maximum(segment_slots[seg], 0).astype(jnp.int32)
    visit_lo = jnp.where(real, lo[seg], 0).astype(jnp.int32)
    visit_hi = jnp.where(real, hi[seg], 0).astype(jnp.int32)

    p = jnp.arange(num_tokens, dtype=jnp.int32)
    row = jnp.where(p < segment_starts[-1], p, -1)
    token_row = jnp.full((num_tokens,), -1, jnp.int32).at[order].set(row)
    return GroupMetadata(order, visit_tile, visit_slot, visit_lo, visit_hi, token_row, num_visits.astype(jnp.int32))
