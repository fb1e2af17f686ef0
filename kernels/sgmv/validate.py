"""Input checks for SGMV: the bgmv shape checks plus segment metadata checks."""

from __future__ import annotations

import numpy as np

from kernels.bgmv.validate import dynamic_validate_inputs, static_validate_inputs

__all__ = ["dynamic_validate_inputs", "dynamic_validate_segments", "static_validate_inputs", "static_validate_segments"]


def static_validate_segments(token_slots, sorted_order, segment_starts, segment_slots) -> None:
    """Segment arrays have the shapes LoRABatchInfo gives them."""
    num_tokens = token_slots.shape[0]
    if sorted_order.shape != (num_tokens,):
        raise ValueError(f"sorted_order shape {sorted_order.shape} != ({num_tokens},)")
    if segment_starts.ndim != 1 or segment_slots.shape != (segment_starts.shape[0] - 1,):
        raise ValueError(
            f"segment_starts shape {segment_starts.shape} and segment_slots shape {segment_slots.shape} "
            "must be [N+1] and [N]"
        )


def dynamic_validate_segments(token_slots, sorted_order, segment_starts, segment_slots) -> None:
    """On concrete arrays: segments are contiguous runs of the sorted tokens with their slot."""
    slots = np.asarray(token_slots)
    order = np.asarray(sorted_order)
    starts = np.asarray(segment_starts)
    seg_slots = np.asarray(segment_slots)
    if sorted(order.tolist()) != list(range(slots.shape[0])):
        raise ValueError(f"sorted_order {order.tolist()} is not a permutation of the tokens")
    if starts[0] != 0 or np.any(np.diff(starts) < 0) or starts[-1] > slots.shape[0]:
        raise ValueError(f"segment_starts {starts.tolist()} must rise from 0 to at most {slots.shape[0]}")
    for seg, slot in enumerate(seg_slots.tolist()):
        got = slots[order[starts[seg] : starts[seg + 1]]]
        if got.size and (slot < 0 or np.any(got != slot)):
            raise ValueError(f"segment {seg} has slot {slot} but holds tokens of slots {sorted(set(got.tolist()))}")
    covered = int(starts[-1])
    if np.any(slots[order[covered:]] >= 0) or np.count_nonzero(slots >= 0) != covered:
        raise ValueError(f"segments cover {covered} tokens but {int(np.count_nonzero(slots >= 0))} have an adapter")
