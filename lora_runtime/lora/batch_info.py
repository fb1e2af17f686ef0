"""Per-step adapter metadata handed to the jitted step; every shape is static."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Bits of LoRABatchInfo.slot_flags: what a slot's adapter holds beside the projections' A and B.
SLOT_DORA, SLOT_EMBED, SLOT_HEAD, SLOT_BIAS = 1, 2, 4, 8
# Columns of LoRABatchInfo.slot_saved: the saved-module slot (modules_to_save) of each module.
SAVED_COLUMNS = {"embed_tokens": 0, "lm_head": 1}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRABatchInfo:
    """Which slot each token uses, and the slot-sorted view SGMV needs.

    `token_slots[t] == -1` means token t uses no adapter. Tokens are sorted by slot
    (stable; no-adapter tokens last) into `sorted_order`; segment i covers sorted
    positions `segment_starts[i] : segment_starts[i + 1]` and uses slot
    `segment_slots[i]`. Unused segments have slot -1 and zero length. There are N =
    min(S, T, max_segments) segments: no step uses more distinct adapters than it holds
    sequences, and formulations that read each distinct adapter once size by N.
    """

    token_slots: jax.Array  # i32[T]
    slot_scalings: jax.Array  # f32[S]
    slot_ranks: jax.Array  # i32[S]
    sorted_order: jax.Array  # i32[T]
    segment_starts: jax.Array  # i32[N + 1]
    segment_slots: jax.Array  # i32[N]
    num_segments: jax.Array  # i32[]
    slot_flags: jax.Array | None = None  # i32[S]: SLOT_* bits of each slot
    # i32[S, 2]: each slot's saved-module slot per SAVED_COLUMNS module (memory_pool), -1 for none
    slot_saved: jax.Array | None = None

    def saved_slots(self, module: str, token_slots: jax.Array) -> jax.Array:
        """i32[T]: the saved-module slot of `module` for each of `token_slots` (global
        slots), -1 where its adapter has none."""
        if self.slot_saved is None:
            return jnp.full(jnp.shape(token_slots), -1, jnp.int32)
        slots = jnp.asarray(token_slots)
        saved = jnp.asarray(self.slot_saved)[jnp.maximum(slots, 0), SAVED_COLUMNS[module]]
        return jnp.where(slots >= 0, saved, -1)

    def uses(self, flag: int) -> jax.Array:
        """bool[]: whether any token's adapter has `flag` (its extra work is skipped otherwise)."""
        if self.slot_flags is None:
            return jnp.zeros((), bool)
        slots = jnp.asarray(self.token_slots)
        has = (jnp.asarray(self.slot_flags)[jnp.maximum(slots, 0)] & flag) != 0
        return jnp.any(has & (slots >= 0))

    def for_class(self, first: int, count: int) -> LoRABatchInfo:
        """The view of one rank class (slots [first, first + count), see memory_pool): its
        tokens keep their class-local slot, every other token has -1, and the sorted order
        and segments start at the class's tokens, contiguous once sorted by slot. Runs in
        the step (arrays may be traced); the whole pool's class is the info itself."""
        if first == 0 and count == self.num_slots:
            return self
        ts = jnp.asarray(self.token_slots)
        mine = (ts >= first) & (ts < first + count)
        seg = jnp.asarray(self.segment_slots)
        used = seg >= 0
        before = jnp.sum(used & (seg < first), dtype=jnp.int32)  # used segments ascend by slot
        upto = jnp.sum(used & (seg < first + count), dtype=jnp.int32)
        starts = jnp.asarray(self.segment_starts)
        lo, hi = starts[before], starts[upto]
        n = seg.shape[0]
        moved = jnp.minimum(jnp.arange(n + 1, dtype=jnp.int32) + before, n)
        i = jnp.arange(n)
        seg_moved = jnp.where(i < upto - before, seg[jnp.minimum(i + before, n - 1)] - first, -1)
        flags = None if self.slot_flags is None else jnp.asarray(self.slot_flags)[first:first + count]
        saved = None if self.slot_saved is None else jnp.asarray(self.slot_saved)[first:first + count]
        return LoRABatchInfo(
            token_slots=jnp.where(mine, ts - first, -1).astype(jnp.int32),
            slot_scalings=jnp.asarray(self.slot_scalings)[first:first + count],
            slot_ranks=jnp.asarray(self.slot_ranks)[first:first + count],
            sorted_order=jnp.roll(jnp.asarray(self.sorted_order), -lo),
            segment_starts=(jnp.clip(starts[moved], lo, hi) - lo).astype(jnp.int32),
            segment_slots=seg_moved.astype(jnp.int32),
            num_segments=upto - before,
            slot_flags=flags,
            slot_saved=saved,
        )

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    @property
    def num_slots(self) -> int:
        return self.slot_scalings.shape[0]


def build_batch_info(
    token_slots: np.ndarray,  # i32[T], -1 = no adapter
    slot_scalings: np.ndarray,  # f32[S]
    slot_ranks: np.ndarray,  # i32[S]
    max_segments: int | None = None,
    slot_flags: np.ndarray | None = None,  # i32[S], SLOT_* bits
    slot_saved: np.ndarray | None = None,  # i32[S, 2], saved-module slots (SAVED_COLUMNS), -1 none
) -> LoRABatchInfo:
    """Computes the sorted/segment metadata on the host (cheap numpy) and packs it.

    `max_segments`: the most distinct adapters a step of this shape can use (the
    sequences it holds); the segment arrays have N = min(S, T, max_segments) entries.
    """
    token_slots = np.asarray(token_slots, dtype=np.int32)
    num_slots = int(np.asarray(slot_scalings).shape[0])
    if token_slots.ndim != 1:
        raise ValueError(f"token_slots must be 1-D, got shape {token_slots.shape}")
    num_segments = max(1, min(num_slots, token_slots.shape[0], max_segments or num_slots))
    bad = token_slots[(token_slots < -1) | (token_slots >= num_slots)]
    if bad.size:
        raise ValueError(f"token slot {int(bad[0])} outside [-1, {num_slots})")
    # No-adapter tokens sort last: key them past every real slot.
    keys = np.where(token_slots < 0, num_slots, token_slots)
    sorted_order = np.argsort(keys, kind="stable").astype(np.int32)
    used, counts = np.unique(token_slots[token_slots >= 0], return_counts=True)
    n = len(used)
    if n > num_segments:
        raise ValueError(f"the tokens use {n} distinct slots, more than {num_segments=} (max_segments={max_segments})")
    segment_slots = np.full(num_segments, -1, dtype=np.int32)
    segment_slots[:n] = used
    starts = np.zeros(num_segments + 1, dtype=np.int32)
    starts[1 : n + 1] = np.cumsum(counts)
    starts[n + 1 :] = starts[n]
    return LoRABatchInfo(
        token_slots=token_slots,
        slot_scalings=np.asarray(slot_scalings, dtype=np.float32),
        slot_ranks=np.asarray(slot_ranks, dtype=np.int32),
        sorted_order=sorted_order,
        segment_starts=starts,
        segment_slots=segment_slots,
        num_segments=np.int32(n),
        slot_flags=np.zeros(num_slots, np.int32) if slot_flags is None else np.asarray(slot_flags, np.int32),
        slot_saved=(np.full((num_slots, len(SAVED_COLUMNS)), -1, np.int32) if slot_saved is None
                    else np.asarray(slot_saved, np.int32)),
    )
