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


@pytest.mark.parametrize("gpu", [False, True])
def test_a_pool_wider_than_the_batch_adds_no_grid_steps(gpu):
    """A step's info has at most max_segments segments (the sequences it holds): the grid is
    bounded by them, not by the pool's slots, and still covers every token."""
    rng = np.random.default_rng(1)
    slots = rng.choice([3, 17, 40, 62, -1], size=48).astype(np.int32)
    num_slots, tm, segments = 64, 8, 6
    info = build_batch_info(slots, np.ones(num_slots, np.float32), np.full(num_slots, 8, np.int32),
                            max_segments=segments)
    args = (info.sorted_order, info.segment_starts, info.segment_slots, num_slots, tm)
    if gpu:
        meta = tiles_from_segments(*args)
        assert meta.grid_tiles == max_tiles(48, segments, tm) < max_tiles(48, num_slots, tm)
        order, start, end = (np.asarray(x) for x in (meta.order, meta.tile_start, meta.tile_end))
        seen = [t for g in range(meta.grid_tiles) for t in order[start[g]:end[g]]]
        assert sorted(seen) == np.flatnonzero(slots >= 0).tolist()
        assert all(np.all(slots[order[start[g]:end[g]]] == int(meta.tile_slot[g])) for g in range(meta.grid_tiles))
    else:
        meta = group_metadata(*args)
        assert meta.grid_visits == max_visits(48, segments, tm) == 6 + 5 < max_visits(48, num_slots, tm)
        order = np.asarray(meta.order)
        covered = np.zeros(48 + tm, int)
        for v in range(int(meta.num_visits)):
            rows = np.arange(int(meta.visit_tile[v]) * tm, int(meta.visit_tile[v]) * tm + tm)
            hit = rows[(rows >= int(meta.visit_lo[v])) & (rows < int(meta.visit_hi[v]))]
            covered[hit] += 1
            assert np.all(slots[order[hit]] == int(meta.visit_slot[v]))
        assert np.array_equal(covered[:48], (np.arange(48) < int(np.sum(slots >= 0))).astype(int))


def test_each_kernel_module_imports_first():
    """A module imported first in a fresh interpreter (a user's `import kernels.sgmv.metadata`)
    finds no import cycle (kernels.bgmv and kernels.dispatch import each other)."""
    import subprocess
    import sys

    modules = ["kernels.sgmv.metadata", "kernels.sgmv.tpu", "kernels.bgmv.gpu", "kernels.bgmv.tuned_block_sizes",
               "kernels.dispatch", "kernels.paged_attention.write"]
    procs = {m: subprocess.Popen([sys.executable, "-c", f"import {m}"], stderr=subprocess.PIPE, text=True)
             for m in modules}
    failed = {m: p.communicate(timeout=120)[1].strip().splitlines()[-1:] for m, p in procs.items()}
    assert {m: err for m, err in failed.items() if procs[m].returncode} == {}
