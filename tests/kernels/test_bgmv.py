"""BGMV kernels (Triton and Mosaic, in interpret mode) and the XLA path against a per-token loop.

The matrix is pairwise rather than cartesian (interpret mode is slow): every value of
T {1, 7, 16, 100}, slots {1, 4, 32}, rank {4, 8, 16, 64}, slices {1, 2, 3}, dtype and
platform appears, and most pairs of them do.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import xla
from kernels.bgmv import bgmv, bgmv_expand, bgmv_shrink
from kernels.bgmv.ref import ref_bgmv
from kernels.bgmv.tuned_block_sizes import BlockSizes
from tests.kernels.naive import assert_close, make_inputs, naive_expand, naive_lora, naive_shrink

F32, BF16 = jnp.float32, jnp.bfloat16
OUTS = (128, 64, 64)  # q-like, then GQA k/v-like slices
IN = 256

# Small blocks so K tiling, split-K and several column tiles are exercised at small sizes.
GPU_BLOCK = BlockSizes(tm=16, bk=64, bn=64, num_splits=2)


def tpu_block(dtype):
    return BlockSizes(tm=16 if dtype == BF16 else 8, bk=128, bn=64)


def block_for(platform, dtype):
    return GPU_BLOCK if platform == "gpu" else tpu_block(dtype)


MATRIX = [  # T, S, R, slices, dtype, platform
    (1, 1, 4, 1, F32, "gpu"),
    (1, 4, 16, 3, BF16, "tpu"),
    (1, 32, 64, 2, F32, "tpu"),
    (7, 1, 8, 2, BF16, "gpu"),
    (7, 4, 4, 3, F32, "tpu"),
    (7, 32, 16, 1, BF16, "gpu"),
    (7, 4, 64, 2, F32, "gpu"),
    (16, 1, 16, 3, F32, "gpu"),
    (16, 4, 64, 1, BF16, "tpu"),
    (16, 32, 8, 2, F32, "tpu"),
    (100, 1, 64, 3, BF16, "gpu"),
    (100, 4, 8, 1, F32, "gpu"),
    (100, 32, 4, 2, BF16, "tpu"),
]


@pytest.mark.parametrize("num_tokens,num_slots,rank,n,dtype,platform", MATRIX)
def test_fused_matches_naive_loop(num_tokens, num_slots, rank, n, dtype, platform):
    d = make_inputs(num_tokens, num_slots, rank, OUTS[:n], IN, dtype, seed=num_tokens * 7 + num_slots)
    got = bgmv(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"], d["ranks"],
               platform=platform, interpret=True, block=block_for(platform, dtype))
    want = naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])
    for g, w in zip(got, want):
        assert g.dtype == dtype
        assert_close(g, w, dtype)


@pytest.mark.parametrize("platform,dtype", [("gpu", F32), ("tpu", BF16), ("cpu", F32)])
def test_shrink_and_expand_halves(platform, dtype):
    d = make_inputs(9, 4, 8, OUTS, IN, dtype, seed=11)
    kw = dict(platform=platform, interpret=platform != "cpu",
              block=None if platform == "cpu" else block_for(platform, dtype))
    v = bgmv_shrink(d["x"], d["a"], d["slots"], d["scalings"], d["ranks"], n_slices=3, **kw)
    assert v.dtype == jnp.float32
    assert_close(v, naive_shrink(d["x"], d["a"], d["slots"], d["scalings"], 3), dtype)
    got = bgmv_expand(v, d["b"], d["base"], d["slots"], d["scalings"], d["ranks"], **kw)
    for g, w in zip(got, naive_expand(v, d["b"], d["base"], d["slots"])):
        assert_close(g, w, dtype)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize("case", ["no_adapter", "one_adapter", "ragged", "mixed_ranks"])
def test_special_batches(platform, case):
    num_tokens, num_slots, rank = 37, 6, 16
    slots = ranks = None
    if case == "no_adapter":
        slots = np.full(num_tokens, -1)
    elif case == "one_adapter":
        slots = np.full(num_tokens, 4)
    elif case == "ragged":  # runs of 1, 17 (crosses a 16-tile), 3, and a no-adapter tail
        slots = np.array([0] + [5] * 17 + [2] * 3 + [-1] * 16)[np.random.default_rng(1).permutation(num_tokens)]
    else:
        ranks = [16, 1, 8, 4, 2, 16]
    d = make_inputs(num_tokens, num_slots, rank, OUTS[:2], IN, F32, seed=5, slots=slots, ranks=ranks)
    got = bgmv(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"], d["ranks"],
               platform=platform, interpret=True, block=block_for(platform, F32))
    want = naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])
    for g, w, base in zip(got, want, d["base"]):
        assert_close(g, w, F32)
        if case == "no_adapter":
            np.testing.assert_array_equal(np.asarray(g), np.asarray(base))


def test_gpu_kernel_skips_rows_past_rank():
    """Garbage in padded rows must not leak: the GPU kernel reads only rows < slot_ranks."""
    d = make_inputs(8, 2, 16, OUTS[:1], IN, F32, seed=3, slots=[0, 1] * 4, ranks=[4, 16])
    a = d["a"].at[0, 4:].set(1e6)
    b = (d["b"][0].at[0, 4:].set(1e6),)
    got = bgmv(d["x"], a, b, d["base"], d["slots"], d["scalings"], d["ranks"],
               platform="gpu", interpret=True, block=GPU_BLOCK)
    want = naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])
    assert_close(got[0], want[0], F32)


@pytest.mark.parametrize("formulation", xla.FORMULATIONS)
def test_xla_formulations(formulation):
    d = make_inputs(13, 5, 8, OUTS, IN, F32, seed=2)
    got = xla.lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"], formulation)
    for g, w in zip(got, naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])):
        assert_close(g, w, F32)


@pytest.mark.parametrize("num_tokens,num_slots,slots", [
    (3, 8, [-1, -1, -1]),  # no adapter anywhere
    (12, 3, [2, -1, 0, 2, 1, -1, 0, 0, 1, 2, -1, 1]),  # every slot and no-adapter tokens, S < T
    (4, 16, [15, 3, 15, 0]),  # S > T: at most T distinct
])
@pytest.mark.parametrize("formulation", ["grouped", "loop"])
def test_distinct_slot_formulations(num_tokens, num_slots, slots, formulation):
    d = make_inputs(num_tokens, num_slots, 8, OUTS[:2], IN, F32, seed=5, slots=slots)
    found = np.asarray(xla.step_slots(d["slots"], num_slots, xla.distinct_bound(num_slots, num_tokens)))
    distinct = sorted({s for s in slots if s >= 0})
    assert found[: len(distinct)].tolist() == distinct and (found[len(distinct):] == -1).all()
    got = jax.jit(lambda *a: xla.lora(*a, formulation))(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])
    for g, w in zip(got, naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])):
        assert_close(g, w, F32)


def test_jnp_reference_matches_naive_loop():
    d = make_inputs(10, 3, 8, OUTS, IN, F32, seed=4)
    got = ref_bgmv(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])
    for g, w in zip(got, naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])):
        assert_close(g, w, F32)


def test_jits_once_for_any_slot_assignment():
    d = make_inputs(16, 4, 8, OUTS[:1], IN, F32, seed=6)
    traces = []

    @jax.jit
    def step(slots):
        traces.append(1)
        return bgmv(d["x"], d["a"], d["b"], d["base"], slots, d["scalings"], d["ranks"],
                    platform="gpu", interpret=True, block=GPU_BLOCK)

    for seed in range(2):
        slots = jnp.asarray(np.random.default_rng(seed).integers(-1, 4, size=16), jnp.int32)
        got = step(slots)
        assert_close(got[0], naive_lora(d["x"], d["a"], d["b"], d["base"], slots, d["scalings"])[0], F32)
    assert len(traces) == 1


@pytest.mark.parametrize("num_tokens,num_slots,rank,n,dtype", [
    (1, 1, 4, 1, F32),
    (7, 4, 64, 2, F32),
    (16, 32, 8, 3, BF16),
    (100, 4, 16, 3, BF16),
])
def test_gpu_single_launch_matches_naive_loop(num_tokens, num_slots, rank, n, dtype):
    """The one-kernel GPU variant: several K blocks, column blocks, GQA slices, slot -1, mixed ranks."""
    d = make_inputs(num_tokens, num_slots, rank, OUTS[:n], IN, dtype, seed=num_tokens * 5 + rank)
    block = BlockSizes(tm=16, bk=64, bn=64, single_launch=True)
    got = bgmv(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"], d["ranks"],
               platform="gpu", interpret=True, block=block)
    want = naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])
    for g, w in zip(got, want):
        assert g.dtype == dtype
        assert_close(g, w, dtype)


@pytest.mark.parametrize("slots", [
    [1, 1, 0, 2, 1, 1, 1, 0, 0, 2, -1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],  # one slot over several tiles
    [2] * 21,  # one slot: a single fetch a column pass
])
def test_tpu_kernel_streams_weights_over_column_passes(slots):
    """The Mosaic kernels fetch each step's adapter block from the pool in HBM themselves:
    a 384-wide slice in 128-column passes, runs of one slot sharing a fetch, double buffers
    alternating across passes."""
    d = make_inputs(len(slots), 3, 8, (384, 128), IN, F32, seed=9, slots=slots)
    got = bgmv(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"], d["ranks"],
               platform="tpu", interpret=True, block=BlockSizes(tm=8, bk=128, bn=128))
    want = naive_lora(d["x"], d["a"], d["b"], d["base"], d["slots"], d["scalings"])
    for g, w in zip(got, want):
        assert_close(g, w, F32)
