"""SGMV (prefill) kernels against a per-token loop and the per-segment reference, host segments."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels.bgmv.tuned_block_sizes import BlockSizes
from kernels.sgmv import sgmv, sgmv_expand, sgmv_shrink
from kernels.sgmv.ref import ref_sgmv
from lora_runtime.lora.batch_info import build_batch_info
from tests.kernels.naive import assert_close, make_inputs, naive_expand, naive_lora, naive_shrink

F32, BF16 = jnp.float32, jnp.bfloat16
OUTS = (128, 64, 64)
IN = 256


def block_for(platform, dtype):
    if platform == "gpu":
        return BlockSizes(tm=16, bk=64, bn=64, num_splits=2)
    return BlockSizes(tm=16 if dtype == BF16 else 8, bk=128, bn=64)


def segments(d):
    info = build_batch_info(np.asarray(d["slots"]), np.asarray(d["scalings"]), np.asarray(d["ranks"]))
    return info.sorted_order, info.segment_starts, info.segment_slots


def run(d, platform, dtype):
    order, starts, seg_slots = segments(d)
    return sgmv(d["x"], d["a"], d["b"], d["base"], d["slots"], order, starts, seg_slots, d["scalings"], d["ranks"],
                platform=platform, interpret=True, block=block_for(platform, dtype))


@pytest.mark.parametrize("num_tokens,num_slots,rank,n,dtype,platform", [
    (100, 4, 16, 3, BF16, "tpu"),
    (100, 32, 8, 1, F32, "gpu"),
    (7, 1, 64, 2, F32, "tpu"),
    (16, 4, 4, 2, BF16, "gpu"),
])
def test_fused_matches_naive_loop(num_tokens, num_slots, rank, n, dtype, platform):
    d = make_inputs(num_tokens, num_slots, rank, OUTS[:n], IN, dtype, seed=num_tokens + rank)
    want = naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])
    for g, w in zip(run(d, platform, dtype), want):
        assert_close(g, w, dtype)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_ragged_segments_and_no_adapter_tail(platform):
    # Runs of 1, 17 and 3 tokens cut across 8- and 16-row tiles; 9 tokens have no adapter.
    slots = np.array([2] + [0] * 17 + [3] * 3 + [-1] * 9)[np.random.default_rng(7).permutation(30)]
    d = make_inputs(30, 4, 8, OUTS[:2], IN, F32, seed=8, slots=slots, ranks=[8, 2, 4, 8])
    order, starts, seg_slots = segments(d)
    want = ref_sgmv(d["x"], d["a"], d["b"], d["base"], order, starts, seg_slots, d["scalings"])
    naive = naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])
    for g, w, w2 in zip(run(d, platform, F32), want, naive):
        assert_close(g, w, F32)
        assert_close(w, w2, F32)


@pytest.mark.parametrize("platform", ["gpu", "tpu", "cpu"])
def test_shrink_and_expand_halves(platform):
    d = make_inputs(21, 4, 8, OUTS, IN, F32, seed=12)
    order, starts, seg_slots = segments(d)
    block = None if platform == "cpu" else block_for(platform, F32)
    kw = dict(platform=platform, interpret=platform != "cpu", block=block)
    v = sgmv_shrink(d["x"], d["a"], d["slots"], order, starts, seg_slots, d["scalings"], d["ranks"], n_slices=3, **kw)
    assert_close(v, naive_shrink(d["x"], d["a"], d["slots"], d["scalings"], 3), F32)
    got = sgmv_expand(v, d["b"], d["base"], d["slots"], order, starts, seg_slots, d["scalings"], d["ranks"], **kw)
    for g, w in zip(got, naive_expand(v, d["b"], d["base"], d["slots"])):
        assert_close(g, w, F32)


@pytest.mark.parametrize("platform", ["gpu", "tpu", "cpu"])
def test_segments_bounded_by_sequences(platform):
    # 40 tokens of 3 sequences over a 32-slot pool: the host gives 3 segments, not 32.
    slots = np.array([30] * 20 + [-1] * 5 + [4] * 10 + [30] * 5)
    d = make_inputs(40, 32, 8, OUTS[:2], IN, F32, seed=9, slots=slots)
    info = build_batch_info(slots, np.asarray(d["scalings"]), np.asarray(d["ranks"]), max_segments=3)
    assert info.segment_slots.tolist() == [4, 30, -1] and info.segment_starts.shape == (4,)
    got = sgmv(d["x"], d["a"], d["b"], d["base"], d["slots"], info.sorted_order, info.segment_starts,
               info.segment_slots, d["scalings"], d["ranks"], platform=platform, interpret=platform != "cpu",
               block=None if platform == "cpu" else block_for(platform, F32))
    for g, w in zip(got, naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])):
        assert_close(g, w, F32)


def test_more_distinct_slots_than_segments_is_refused():
    with pytest.raises(ValueError, match="3 distinct slots, more than num_segments=2"):
        build_batch_info(np.array([0, 1, 2]), np.ones(4, np.float32), np.full(4, 8, np.int32), max_segments=2)


def test_tpu_kernels_stream_weights_over_column_passes():
    """The Mosaic SGMV kernels fetch each visit's adapter block from the pool in HBM: a
    384-wide slice in 128-column passes; a run of one slot's visits (17 tokens over three
    8-row tiles) shares a fetch; tiles visited by two slots."""
    slots = np.array([2] + [0] * 17 + [1] * 3 + [-1] * 4)[np.random.default_rng(3).permutation(25)]
    d = make_inputs(25, 3, 8, (384, 128), IN, F32, seed=4, slots=slots)
    order, starts, seg_slots = segments(d)
    got = sgmv(d["x"], d["a"], d["b"], d["base"], d["slots"], order, starts, seg_slots, d["scalings"], d["ranks"],
               platform="tpu", interpret=True, block=BlockSizes(tm=8, bk=128, bn=128))
    for g, w in zip(got, naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])):
        assert_close(g, w, F32)
