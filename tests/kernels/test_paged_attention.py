"""Paged attention against a naive loop, for every formulation, at random page layouts;
the TPU kernel lowered for TPU and the GPU kernel for CUDA at real model shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.common import gpu_lowering_target
from kernels.paged_attention import paged_attention, ref_paged_attention
from tests.kernels.naive import assert_close, naive_paged_attention


def random_case(seed, *, groups=3, c=1, heads=4, kv_heads=2, d=32, bs=8, pages=5, dtype=jnp.float32,
                shared_prefix=0):
    """Pages in random order; groups may share their first `shared_prefix` pages (a cached prefix)."""
    rng = np.random.default_rng(seed)
    num_pages = 1 + groups * pages
    k = rng.standard_normal((kv_heads, num_pages, bs, d))
    v = rng.standard_normal((kv_heads, num_pages, bs, d))
    order = rng.permutation(np.arange(1, num_pages))  # page 0 is the null page
    tables = order[: groups * pages].reshape(groups, pages)
    tables[:, :shared_prefix] = tables[0, :shared_prefix]
    # Ragged positions: each group's chunk ends somewhere in its pages.
    q_start = np.array([rng.integers(0, pages * bs - c + 1) for _ in range(groups)], np.int32)
    q = rng.standard_normal((groups, c, heads, d))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(tables, jnp.int32), jnp.asarray(q_start))


def test_reference_by_hand():
    """One group, one head, two keys on two pages: softmax of q.k over positions 0 and 1."""
    k = jnp.zeros((1, 3, 1, 2)).at[0, 2, 0].set(jnp.array([1.0, 0.0])).at[0, 1, 0].set(jnp.array([0.0, 1.0]))
    v = jnp.zeros((1, 3, 1, 2)).at[0, 2, 0].set(jnp.array([10.0, 0.0])).at[0, 1, 0].set(jnp.array([0.0, 10.0]))
    q = jnp.array([[[[2.0, 0.0]]]])  # position 1: sees page 2 (pos 0) and page 1 (pos 1)
    out = ref_paged_attention(q, k, v, jnp.array([[2, 1]], jnp.int32), jnp.array([1], jnp.int32), sm_scale=1.0)
    w0 = np.exp(2.0) / (np.exp(2.0) + 1.0)
    np.testing.assert_allclose(out[0, 0, 0], [10 * w0, 10 * (1 - w0)], rtol=1e-6)
    # At position 0 it sees only the first key.
    out = ref_paged_attention(q, k, v, jnp.array([[2, 1]], jnp.int32), jnp.array([0], jnp.int32), sm_scale=1.0)
    np.testing.assert_allclose(out[0, 0, 0], [10.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize("c,window,shared", [(1, None, 0), (1, 11, 0), (5, None, 2), (5, 6, 1)])
def test_reference_against_naive(c, window, shared):
    case = random_case(0, c=c, shared_prefix=shared)
    assert_close(ref_paged_attention(*case, window=window), naive_paged_attention(*case, window=window),
                 jnp.float32)


@pytest.mark.parametrize("platform", ["xla", "tpu", "gpu"])
@pytest.mark.parametrize("c,window,shared,seed", [
    (1, None, 0, 1), (1, None, 3, 2), (1, 13, 0, 3), (4, None, 2, 4), (4, 9, 0, 5), (16, None, 1, 6),
])
def test_platforms_against_naive(platform, c, window, shared, seed):
    """Every formulation (kernels in interpret mode) at random layouts; shared pages, windows,
    several queries per group (the GPU kernel takes one query without a window, else XLA)."""
    case = random_case(seed, c=c, shared_prefix=shared, groups=4, pages=4)
    got = paged_attention(*case, window=window, platform=platform, interpret=True)
    assert_close(got, naive_paged_attention(*case, window=window), jnp.float32)


@pytest.mark.parametrize("platform", ["xla", "tpu", "gpu"])
def test_bf16_and_long_tables(platform):
    """bf16 pages; tables longer than one compute chunk (so the XLA loop, the TPU page axis
    and the GPU k-splits all iterate); queries ending early skip the pages after them."""
    case = random_case(7, c=1, groups=3, pages=40, bs=8, dtype=jnp.bfloat16)
    q, k, v, tables, _ = case
    q_start = jnp.asarray([3, 170, 319], jnp.int32)
    got = paged_attention(q, k, v, tables, q_start, platform=platform, interpret=True)
    assert_close(got, naive_paged_attention(q, k, v, tables, q_start), jnp.bfloat16)


def test_tpu_kernel_steps_over_blocks_of_kv_heads(monkeypatch):
    """A TPU grid step of the chunk kernel takes as many kv heads as fit its VMEM budget: all
    of them for short chunks, fewer for long ones, one when even two would not fit; every
    split gives the same result."""
    from kernels.paged_attention import tpu

    assert tpu.heads_per_step(8, 4, 128, 128, 2) == 8  # one query of Llama-3-8B: every head at once
    assert tpu.heads_per_step(8, 512, 128, 128, 2) == 4  # a 128-token chunk, 4 query heads each
    assert tpu.heads_per_step(4, 8192, 128, 128, 2) == 1
    assert tpu.heads_per_step(6, 1024, 128, 128, 4) in (1, 2, 3)  # a divisor of the kv heads
    case = random_case(11, c=4, groups=3, pages=5, kv_heads=4, heads=8, bs=8)
    want = naive_paged_attention(*case, window=13)
    for budget in (tpu.VMEM_BUDGET, 4 << 10):  # all 4 heads a step, then 1
        monkeypatch.setattr(tpu, "VMEM_BUDGET", budget)
        assert tpu.heads_per_step(4, 4 * 2, 8, 32, 4) == (4 if budget > 1 << 20 else 1)
        assert_close(paged_attention(*case, window=13, platform="tpu", interpret=True), want, jnp.float32)


def test_tpu_chunk_kernel_cuts_a_long_chunk_into_query_blocks(monkeypatch):
    """A chunk whose one-head step would overflow VMEM goes through blocks of its queries
    (a 2048-token chunk of Llama-3-8B's heads asked for 30 MiB of the 16 Mosaic allows);
    every cut gives the same result, windows and shared pages included."""
    from kernels.paged_attention import tpu

    assert tpu.queries_per_step(64, 4, 128, 128, 2) == 64
    assert tpu.queries_per_step(2048, 4, 128, 128, 2) == 256
    assert tpu.queries_per_step(512, 4, 128, 128, 2) == 256
    assert tpu.queries_per_step(2048, 7, 128, 128, 2) in (64, 128)  # its rows whole tiles of 16
    case = random_case(13, c=16, groups=2, pages=6, kv_heads=2, heads=8, bs=8, shared_prefix=2)
    default = tpu.VMEM_BUDGET
    for window in (None, 11):
        want = naive_paged_attention(*case, window=window)
        for budget, blocks in ((default, 1), (40 << 10, 4)):
            monkeypatch.setattr(tpu, "VMEM_BUDGET", budget)
            assert 16 // tpu.queries_per_step(16, 4, 8, 32, 4) == blocks
            assert_close(paged_attention(*case, window=window, platform="tpu", interpret=True), want, jnp.float32)


@pytest.mark.parametrize("kv_heads,heads,bs,pages,window", [
    (8, 32, 8, 1, None),  # one page: one page a step
    (8, 32, 128, 5, None),  # Llama-3-8B's heads: all 8 a step, an odd page count
    (16, 64, 128, 4, 300),  # 8 of 16 heads a step, a window across pages
    (4, 28, 8, 6, 20),  # 7 query heads per kv head (Qwen2.5-7B)
    (32, 32, 128, 3, None),  # one query head each (multi-head attention): 16 of 32 heads a step
])
def test_tpu_decode_computes_every_head_of_a_step_at_once(kv_heads, heads, bs, pages, window):
    """The decode kernel's block-diagonal product over a step's heads and pages equals the
    naive loop, for the head blocks decode_heads_per_step picks."""
    case = random_case(12, c=1, groups=3, pages=pages, kv_heads=kv_heads, heads=heads, bs=bs, d=16)
    assert_close(paged_attention(*case, window=window, platform="tpu", interpret=True),
                 naive_paged_attention(*case, window=window), jnp.float32)


def test_tpu_decode_heads_per_step():
    from kernels.paged_attention import tpu

    assert tpu.decode_heads_per_step(8, 4, 128) == 8  # Llama-3-8B: 1024 keys of a page a step
    assert tpu.decode_heads_per_step(16, 4, 128) == 8
    assert tpu.decode_heads_per_step(32, 1, 128) == 16  # one query head each: 16 rows make a tile
    assert tpu.decode_heads_per_step(32, 4, 16) == 32
    assert tpu.decode_heads_per_step(1, 7, 128) == 1


def test_null_page_rows_stay_finite():
    """Idle groups (position 0, every page the null page) give finite output on every platform."""
    q, k, v, tables, _ = random_case(8, groups=2, pages=3)
    tables = tables.at[1].set(0)
    q_start = jnp.asarray([20, 0], jnp.int32)
    for platform in ("xla", "tpu", "gpu"):
        out = paged_attention(q, k, v, tables, q_start, platform=platform, interpret=True)
        assert np.isfinite(np.asarray(out)).all(), platform


def test_validation_names_the_argument():
    q, k, v, tables, q_start = random_case(9)
    with pytest.raises(ValueError, match="block_tables must be"):
        paged_attention(q, k, v, tables[:2], q_start)
    with pytest.raises(ValueError, match="q_start must be int32"):
        paged_attention(q, k, v, tables, q_start.astype(jnp.float32))
    with pytest.raises(ValueError, match="not a multiple of kv heads"):
        paged_attention(q[:, :, :3], k, v, tables, q_start)
    with pytest.raises(ValueError, match="platform='cuda'"):
        paged_attention(q, k, v, tables, q_start, platform="cuda")


# heads, kv heads, head_dim; Llama-2-7B: multi-head attention (a kv head per query head)
MODELS = {"llama3_8b": (32, 8, 128), "qwen2_5_7b": (28, 4, 128), "llama2_7b": (32, 32, 128)}
# Qwen2.5-7B's 28 heads do not split 8 ways.
TP = {"llama3_8b": (1, 2, 4, 8), "qwen2_5_7b": (1, 2, 4), "llama2_7b": (1, 8)}


def _abstract(model, tp, groups, c, bs, max_seq_len=8192, num_pages=4096):
    heads, kv_heads, d = MODELS[model]
    sds = jax.ShapeDtypeStruct
    pages = sds((kv_heads // tp, num_pages, bs, d), jnp.bfloat16)
    return (sds((groups, c, heads // tp, d), jnp.bfloat16), pages, pages,
            sds((groups, max_seq_len // bs), jnp.int32), sds((groups,), jnp.int32))


@pytest.mark.parametrize("model,tp", [(m, tp) for m in MODELS for tp in TP[m]])
@pytest.mark.parametrize("groups,c", [(64, 1), (8, 64), (1, 512), (1, 2048)])
def test_tpu_lowering_real_shapes(model, tp, groups, c):
    """Decode (64 sequences), the several-sequence extend (8 x 64), a 512- and a 2048-token
    chunk, per device under TP, 128-token pages (the TPU default), with and without a window."""
    args = _abstract(model, tp, groups, c, bs=128)
    for window in (None, 4096):
        text = jax.jit(lambda *a: paged_attention(*a, window=window, platform="tpu")).trace(*args).lower(
            lowering_platforms=("tpu",)).as_text()
        assert text.count("tpu_custom_call") == 1


@pytest.mark.parametrize("model", sorted(MODELS))
def test_gpu_lowering_real_shapes(model):
    args = _abstract(model, 1, groups=64, c=1, bs=16)
    with gpu_lowering_target():
        text = jax.jit(lambda *a: paged_attention(*a, platform="gpu")).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
