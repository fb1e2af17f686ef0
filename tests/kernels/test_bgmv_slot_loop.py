"""The TPU decode kernels that walk a batch's distinct slots (kernels.bgmv.tpu), in interpret
mode against a per-token loop, and lowered for TPU at real shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.bgmv import bgmv, bgmv_expand, bgmv_shrink
from kernels.bgmv import tpu as slot_loop
from kernels.bgmv.tpu import VMEM_BUDGET, distinct_slots, expand_block, tile_slots
from kernels.bgmv.tuned_block_sizes import BlockSizes
from kernels.sgmv import sgmv, sgmv_expand, sgmv_shrink
from lora_runtime.lora.batch_info import build_batch_info
from tests.kernels.naive import assert_close, make_inputs, naive_expand, naive_lora, naive_shrink
from tests.kernels.test_kernel_lowering import lower_bgmv, lower_sgmv

F32, BF16 = jnp.float32, jnp.bfloat16
OUTS = (128, 64, 64)
IN = 256


def loop_block(depth: int) -> BlockSizes:
    return BlockSizes(tm=16, bk=1 << 16, bn=1 << 14, slot_loop=depth)


@pytest.mark.parametrize("slots,num_slots,want", [
    ([3, -1, 3, 0, 5, 5, -1], 8, [0, 3, 5]),
    ([-1, -1, -1], 4, []),
    ([2] * 9, 4, [2]),
    ([6, 5, 4, 3, 2, 1, 0], 7, [0, 1, 2, 3, 4, 5, 6]),
])
def test_distinct_slots_lists_each_used_slot_once(slots, num_slots, want):
    got, count = distinct_slots(jnp.asarray(slots, jnp.int32), num_slots)
    assert got.shape == (min(num_slots, len(slots)),)
    assert int(count[0]) == len(want) and list(np.asarray(got)[:len(want)]) == want


def test_tile_slots_lists_each_tiles_own_slots():
    tok = jnp.asarray([3, 3, -1, 3, 0, 5, 5, 0, -1, -1, -1, -1], jnp.int32)
    slots, count = tile_slots(tok, 8, 4)
    assert slots.shape == (3 * 4,) and list(np.asarray(count)) == [1, 2, 0]
    g = np.asarray(slots).reshape(3, 4)
    assert g[0, 0] == 3 and list(g[1, :2]) == [0, 5]


def prompt_rows(num_tokens: int, seed: int) -> np.ndarray:
    """A packed prompt step's slots: runs of one sequence each (some without an adapter)."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < num_tokens:
        out += [int(rng.integers(-1, 6))] * int(rng.integers(1, 40))
    return np.array(out[:num_tokens])


@pytest.mark.parametrize("num_tokens,tm,dtype", [(100, 16, F32), (130, 32, BF16), (16, 16, BF16), (5, 16, F32)])
def test_prompt_rows_in_tiles_match_naive_loop(num_tokens, tm, dtype):
    """sgmv through the slot-loop kernels: rows in tiles of tm, each walking its own slots."""
    d = make_inputs(num_tokens, 6, 16, OUTS, IN, dtype, seed=num_tokens, slots=prompt_rows(num_tokens, num_tokens))
    info = build_batch_info(np.asarray(d["slots"]), np.asarray(d["scalings"]), np.asarray(d["ranks"]))
    seg = (info.sorted_order, info.segment_starts, info.segment_slots)
    block = BlockSizes(tm=tm, bk=1 << 16, bn=1 << 14, slot_loop=2)
    kw = dict(platform="tpu", interpret=True, block=block)
    got = sgmv(d["x"], d["a"], d["b"], d["base"], d["slots"], *seg, d["scalings"], d["ranks"], **kw)
    for g, w in zip(got, naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])):
        assert g.dtype == dtype and g.shape == w.shape
        assert_close(g, w, dtype)
    v = sgmv_shrink(d["x"], d["a"], d["slots"], *seg, d["scalings"], d["ranks"], n_slices=3, **kw)
    assert_close(v, naive_shrink(d["x"], d["a"], d["slots"], d["scalings"], 3), F32)
    got = sgmv_expand(v, d["b"], d["base"], d["slots"], *seg, d["scalings"], d["ranks"], **kw)
    for g, w in zip(got, naive_expand(v, d["b"], d["base"], d["slots"])):
        assert_close(g, w, dtype)


def test_row_tiles_and_column_blocks_together(monkeypatch):
    d = make_inputs(70, 6, 8, (384, 128), IN, F32, seed=4, slots=prompt_rows(70, 4))
    monkeypatch.setattr(slot_loop, "VMEM_BUDGET", 2 * 16 * 128 * 4 + 2 * 8 * 128 * 4)  # one 128-column block
    assert expand_block(16, 8, 384, 2, 4) == 128
    v = slot_loop.shrink(d["x"], jnp.stack([d["a"]]), jnp.zeros((1,), jnp.int32), d["slots"], depth=2, tm=16,
                         interpret=True)
    want = naive_shrink(d["x"], d["a"], d["slots"], jnp.ones_like(d["scalings"]), 2)
    assert_close(v, want, F32)
    got = slot_loop.expand(v[:, :8], jnp.stack([d["b"][0]]), jnp.zeros((1,), jnp.int32), d["slots"], depth=2,
                           tm=16, interpret=True)
    zero = jnp.zeros((70, 384), F32)
    assert_close(got, naive_expand(v[:, :8], (d["b"][0],), (zero,), d["slots"])[0], F32)


@pytest.mark.parametrize("num_tokens,num_slots,rank,n,dtype,depth", [
    (1, 4, 16, 3, BF16, 2),
    (7, 4, 4, 3, F32, 1),
    (16, 32, 8, 2, F32, 3),
    (33, 8, 16, 1, BF16, 4),
    (100, 32, 64, 2, BF16, 2),
])
def test_fused_matches_naive_loop(num_tokens, num_slots, rank, n, dtype, depth):
    d = make_inputs(num_tokens, num_slots, rank, OUTS[:n], IN, dtype, seed=num_tokens * 3 + depth)
    got = bgmv(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"], d["ranks"],
               platform="tpu", interpret=True, block=loop_block(depth))
    want = naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape
        assert_close(g, w, dtype)


@pytest.mark.parametrize("case", ["no_adapter", "one_adapter", "every_slot", "ragged"])
def test_special_batches_and_halves(case):
    num_tokens, num_slots, rank = 37, 6, 16
    slots = {"no_adapter": np.full(num_tokens, -1), "one_adapter": np.full(num_tokens, 4),
             "every_slot": np.arange(num_tokens) % num_slots,
             "ragged": np.array([0] + [5] * 17 + [2] * 3 + [-1] * 16)[np.random.default_rng(1).permutation(37)]}[case]
    d = make_inputs(num_tokens, num_slots, rank, OUTS[:2], IN, F32, seed=5, slots=slots)
    kw = dict(platform="tpu", interpret=True, block=loop_block(2))
    v = bgmv_shrink(d["x"], d["a"], d["slots"], d["scalings"], d["ranks"], n_slices=2, **kw)
    assert_close(v, naive_shrink(d["x"], d["a"], d["slots"], d["scalings"], 2), F32)
    got = bgmv_expand(v, d["b"], d["base"], d["slots"], d["scalings"], d["ranks"], **kw)
    for g, w, base in zip(got, naive_expand(v, d["b"], d["base"], d["slots"]), d["base"]):
        assert_close(g, w, F32)
        if case == "no_adapter":
            np.testing.assert_array_equal(np.asarray(g), np.asarray(base))


def test_a_stacked_pool_is_read_at_its_layer():
    d = make_inputs(12, 4, 8, OUTS, IN, BF16, seed=3)
    stacked = [jnp.stack([t * (i + 1) for i in range(3)]) for t in (d["a"], *d["b"])]
    got = bgmv(d["x"], stacked[0], tuple(stacked[1:]), d["base"], d["slots"], d["scalings"], d["ranks"],
               layer=jnp.int32(2), platform="tpu", interpret=True, block=loop_block(2))
    a3, b3 = d["a"] * 3, tuple(b * 3 for b in d["b"])
    for g, w in zip(got, naive_lora(d["x"], a3, b3, d["base"], d["slots"], d["scalings"])):
        assert_close(g, w, BF16)


def test_the_expand_splits_a_width_past_its_vmem_budget_into_column_blocks(monkeypatch):
    # 32 rows of rank-64 slots at Llama-3-8B's 14336 fit whole; 512 rows do not.
    assert expand_block(32, 64, 14336, 4, 2) == 14336
    bn = expand_block(512, 64, 14336, 4, 2)
    assert bn < 14336 and 14336 % bn == 0 and bn % 128 == 0
    assert 2 * 512 * bn * 4 + 4 * 64 * bn * 2 <= VMEM_BUDGET
    # In interpret mode with a tiny budget: several column blocks, the same result.
    d = make_inputs(24, 5, 8, (384, 128), IN, F32, seed=9)
    monkeypatch.setattr(slot_loop, "VMEM_BUDGET", 2 * 32 * 128 * 4 + 2 * 8 * 128 * 4)  # one 128-column block
    assert expand_block(32, 8, 384, 2, 4) == 128
    got = bgmv(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"], d["ranks"],
               platform="tpu", interpret=True, block=loop_block(2))
    for g, w in zip(got, naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])):
        assert_close(g, w, F32)


def test_an_output_width_off_the_lane_tile_is_read_whole():
    # An lm_head over a 259-token vocabulary: one column block, its DMA not sliced (on the chip a
    # sliced offset must be a provable multiple of 128).
    assert expand_block(32, 16, 259, 4, 2) == 259
    d = make_inputs(20, 63, 16, (259,), IN, BF16, seed=11)
    got = bgmv(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"], d["ranks"],
               platform="tpu", interpret=True, block=loop_block(4))
    for g, w in zip(got, naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])):
        assert_close(g, w, BF16)


@pytest.mark.parametrize("tp", [1, 8])
def test_it_lowers_for_tpu_at_real_shapes(tp):
    """Llama-3-8B's groups over a 32-layer pool: a kernel per group's shrink and per slice's
    expand (not the visits kernels), the pool left in HBM."""
    text = lower_bgmv("llama3_8b", tp, "tpu", num_tokens=32, layers=32, block=loop_block(4))
    assert text.count("tpu_custom_call") == 4 + 7
    assert "lora_bgmv_shrink" in text and "lora_bgmv_expand" in text and "lora_sgmv" not in text
    assert text.count("input_memory_space_colors") == 4 + 7


def test_prompt_tiles_lower_for_tpu_at_real_shapes(monkeypatch):
    """A 512-token prompt step over a 32-layer pool with the tuned prefill sizes set to the slot
    loop: its kernels, not the visits'."""
    from kernels.bgmv import tuned_block_sizes as tuned
    monkeypatch.setattr(tuned, "TPU_PREFILL_SLOT_LOOP", 4)
    text = lower_sgmv("llama3_8b", 1, num_tokens=512, layers=32)
    assert text.count("tpu_custom_call") == 4 + 7
    assert "lora_bgmv_shrink" in text and "lora_bgmv_expand" in text and "lora_sgmv" not in text


def test_decode_takes_the_tuned_choice_and_prefill_keeps_the_visits(monkeypatch):
    from kernels.bgmv import tuned_block_sizes as tuned
    assert tuned.tpu_block_sizes(BF16, prefill=False).slot_loop == tuned.TPU_DECODE_SLOT_LOOP
    monkeypatch.setattr(tuned, "TPU_DECODE_SLOT_LOOP", 4)
    assert tuned.tpu_block_sizes(BF16, prefill=False).slot_loop == 4
    assert tuned.tpu_block_sizes(BF16, prefill=True).slot_loop == tuned.TPU_PREFILL_SLOT_LOOP
    monkeypatch.setattr(tuned, "TPU_PREFILL_SLOT_LOOP", 2)
    assert tuned.tpu_block_sizes(BF16, prefill=True) == BlockSizes(tm=128, bk=tuned.TPU_WHOLE_K, bn=4096, slot_loop=2)
