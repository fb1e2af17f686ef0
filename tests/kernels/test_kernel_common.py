"""Tile and group metadata: every adapter token lands in exactly one tile of its own slot."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels.common import max_tiles, tiles_from_segments, tiles_from_slots
from kernels.sgmv.metadata import group_metadata, max_visits
from lora_runtime.lora.batch_info import build_batch_info


def check_tiles(slots, num_slots, tm, meta):
    slots = np.asarray(slots)
    order, start, end = np.asarray(meta.order), np.asarray(meta.tile_start), np.asarray(meta.tile_end)
    tile_slot, token_row = np.asarray(meta.tile_slot), np.asarray(meta.token_row)
    n = int(meta.num_tiles)
    assert n <= meta.grid_tiles == max_tiles(len(slots), num_slots, tm)
    seen = []
    for g in range(meta.grid_tiles):
        toks = order[start[g] : end[g]]
        assert len(toks) <= tm and (g < n) == (len(toks) > 0)
        assert np.all(slots[toks] == tile_slot[g])
        for j, t in enumerate(toks):
            assert token_row[t] == g * tm + j
        seen += toks.tolist()
    assert sorted(seen) == np.flatnonzero(slots >= 0).tolist()
    assert np.all(token_row[slots < 0] == -1)
    assert np.all(tile_slot >= 0)


@pytest.mark.parametrize("slots,num_slots,tm", [
    ([2, -1, 0, 2, 3, 2, 0], 4, 2),
    ([-1, -1, -1], 3, 16),
    ([1] * 40, 2, 16),
    ([0] + [1] * 17 + [2] * 3 + [-1] * 4, 3, 16),
])
def test_tiles_from_slots(slots, num_slots, tm):
    check_tiles(slots, num_slots, tm, tiles_from_slots(jnp.asarray(slots, jnp.int32), num_slots, tm))


def test_tiles_from_host_segments_match():
    slots = np.array([3, 3, -1, 0, 3, 1, 1, 1, 0], np.int32)
    info = build_batch_info(slots, np.ones(4, np.float32), np.full(4, 8, np.int32))
    meta = tiles_from_segments(info.sorted_order, info.segment_starts, info.segment_slots, 4, 2)
    check_tiles(slots, 4, 2, meta)


def test_max_tiles_bound_is_tight_and_checked():
    assert max_tiles(64, 64, 16) == 64  # every token its own slot: one tile each
    assert max_tiles(64, 1, 16) == 4
    with pytest.raises(ValueError, match="tm=0"):
        max_tiles(4, 2, 0)


def test_group_metadata_visits_cover_each_sorted_row_once():
    slots = np.array([0] + [1] * 17 + [2] * 3 + [-1] * 4, np.int32)
    rng = np.random.default_rng(0)
    slots = slots[rng.permutation(len(slots))]
    info = build_batch_info(slots, np.ones(3, np.float32), np.full(3, 8, np.int32))
    tm = 8
    meta = group_metadata(info.sorted_order, info.segment_starts, info.segment_slots, 3, tm)
    assert meta.grid_visits == max_visits(len(slots), 3, tm)
    covered = np.zeros(len(slots) + tm, int)
    for v in range(int(meta.num_visits)):
        rows = np.arange(int(meta.visit_tile[v]) * tm, int(meta.visit_tile[v]) * tm + tm)
        hit = rows[(rows >= int(meta.visit_lo[v])) & (rows < int(meta.visit_hi[v]))]
        covered[hit] += 1
        order = np.asarray(meta.order)
        assert np.all(slots[order[hit]] == int(meta.visit_slot[v]))
    assert np.array_equal(covered[: len(slots)], (np.arange(len(slots)) < int(info.segment_starts[-1])).astype(int))
