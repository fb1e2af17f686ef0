"""The KV write: the TPU (Mosaic) kernel, in interpret mode, gives the XLA scatter's cache for
prefill runs, scattered decode tokens, tokens sharing a sub-block apart, runs across chunks and
dropped padding; it lowers for TPU at real shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.common import sublane_rows
from kernels.paged_attention.write import (
    CHUNK_BUDGET, MAX_CHUNK, chunk_tokens, tpu_write_pages, write_kv_pages, write_pages,
)


def _case(seed, dtype, heads=2, blocks=6, bs=16, d=128):
    rng = np.random.default_rng(seed)
    pages = jnp.asarray(rng.standard_normal((heads, blocks, bs, d)), dtype)
    return pages, rng


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_kernel_gives_the_scatters_cache(dtype):
    pages, rng = _case(0, dtype)
    total = pages.shape[1] * pages.shape[2]
    # Padding first, a prefill run across a sub-block boundary, padding inside, decode tokens
    # on other blocks, padding last (slots past the cache are dropped).
    slots = jnp.asarray([total + 3, 13, 14, 15, 16, 17, total, 5, 70, 49, total + 1, total + 9], jnp.int32)
    new = jnp.asarray(rng.standard_normal((slots.shape[0], 2, 128)), dtype)
    want = write_pages(pages, new, slots, platform="xla")
    got = jax.jit(lambda p, n, s: write_pages(p, n, s, platform="tpu", interpret=True))(pages, new, slots)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # The written rows hold the new values; the rest of the cache is untouched.
    flat = np.asarray(got, np.float32).reshape(2, total, 128)
    np.testing.assert_array_equal(flat[:, 49], np.asarray(new[9], np.float32))
    untouched = np.setdiff1d(np.arange(total), [13, 14, 15, 16, 17, 5, 70, 49])
    np.testing.assert_array_equal(flat[:, untouched],
                                  np.asarray(pages, np.float32).reshape(2, total, 128)[:, untouched])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_runs_across_chunks_and_apart(dtype):
    """150 tokens: three chunks of 64 (the last padded), a prefill run crossing both chunk
    boundaries mid sub-block, and tokens on one sub-block that are not adjacent."""
    pages, rng = _case(3, dtype, blocks=24, bs=16)
    total = pages.shape[1] * pages.shape[2]
    prefill = np.arange(40, 40 + 140)  # slots 40..179: 64 and 128 fall inside sub-blocks
    apart = np.array([300, 200, 301, total + 5, 302, 201, -1, 303, 302 + 16, 210])
    slots = jnp.asarray(np.concatenate([prefill, apart]), jnp.int32)
    assert slots.shape[0] == 150 and chunk_tokens(150, 2 * 16 * 128 * 2) == MAX_CHUNK
    new = jnp.asarray(rng.standard_normal((150, 2, 128)), dtype)
    want = write_pages(pages, new, slots, platform="xla")
    got = jax.jit(lambda p, n, s: write_pages(p, n, s, platform="tpu", interpret=True))(pages, new, slots)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # Slot -1 is dropped on both paths, not taken as the cache's last slot.
    np.testing.assert_array_equal(np.asarray(want)[:, -1, -1], np.asarray(pages)[:, -1, -1])
    np.testing.assert_array_equal(np.asarray(want).reshape(2, total, 128)[:, 318], np.asarray(new[-2], np.float32))


def test_chunk_fits_vmem():
    # 8 bf16 kv heads: 32 KiB a token, a decode batch of 64 in one step.
    assert chunk_tokens(64, 8 * 16 * 128 * 2) == 64
    assert chunk_tokens(5, 8 * 16 * 128 * 2) == 8
    assert chunk_tokens(1, 8 * 16 * 128 * 2) == 1
    # 32 f32 kv heads: 128 KiB a token, so 32 tokens a step.
    assert chunk_tokens(2048, 32 * 8 * 128 * 4) == 32 and 32 * 32 * 8 * 128 * 4 <= CHUNK_BUDGET


def test_all_dropped_leaves_the_cache_unchanged():
    pages, rng = _case(1, jnp.float32)
    new = jnp.asarray(rng.standard_normal((3, 2, 128)), jnp.float32)
    got = tpu_write_pages(pages, new, jnp.asarray([-1, 10**6, 96], jnp.int32), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(pages))


def test_block_size_must_be_whole_sublane_tiles():
    assert sublane_rows(jnp.float32) == 8 and sublane_rows(jnp.bfloat16) == 16
    pages, _ = _case(2, jnp.bfloat16, bs=8)
    with pytest.raises(ValueError, match="block size 8 is not a multiple of the 16-row"):
        tpu_write_pages(pages, jnp.zeros((1, 2, 128), jnp.bfloat16), jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="platform='gpu'"):
        write_pages(pages, jnp.zeros((1, 2, 128), jnp.bfloat16), jnp.zeros((1,), jnp.int32), platform="gpu")


@pytest.mark.parametrize("tokens", [64, 2048])
def test_tpu_lowering_real_shapes(tokens):
    """Llama-3-8B's K pages of 32 layers (8 kv heads, 128-token blocks), decode and a prefill."""
    sds = jax.ShapeDtypeStruct
    args = (sds((8, 32 * 512, 128, 128), jnp.bfloat16), sds((tokens, 8, 128), jnp.bfloat16), sds((tokens,), jnp.int32))
    text = jax.jit(lambda p, n, s: tpu_write_pages(p, n, s)).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1


def test_tpu_lowering_many_heads_float32():
    """32 kv heads in float32 (a model without grouped queries): 32 tokens a grid step."""
    sds = jax.ShapeDtypeStruct
    args = (sds((32, 1024, 16, 128), jnp.float32), sds((100, 32, 128), jnp.float32), sds((100,), jnp.int32))
    text = jax.jit(lambda p, n, s: tpu_write_pages(p, n, s)).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 1


def test_k_and_v_in_one_kernel():
    """The model's write: K and V at the same slots through one kernel, as two XLA scatters would."""
    k_pages, rng = _case(4, jnp.bfloat16, blocks=8, bs=16)
    v_pages = k_pages[::-1] * 2
    slots = jnp.asarray([7, 8, 9, 40, 41, 200, 100], jnp.int32)  # 200 is past the cache: dropped
    k, v = (jnp.asarray(rng.standard_normal((7, 2, 128)), jnp.bfloat16) for _ in range(2))
    want = write_kv_pages(k_pages, v_pages, k, v, slots, platform="xla")
    got = jax.jit(lambda *a: write_kv_pages(*a, platform="tpu", interpret=True))(k_pages, v_pages, k, v, slots)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    assert not np.array_equal(np.asarray(got[0], np.float32), np.asarray(got[1], np.float32))


@pytest.mark.parametrize("kv_heads", [8, 2, 1])
def test_tpu_lowering_k_and_v(kv_heads):
    """One kernel for K and V, each cache aliased to its output, at Llama-3-8B's per-device kv
    heads under tensor parallelism of 1, 4 and 8."""
    sds = jax.ShapeDtypeStruct
    pages = sds((kv_heads, 32 * 512, 128, 128), jnp.bfloat16)
    new = sds((64, kv_heads, 128), jnp.bfloat16)
    lowered = jax.jit(lambda *a: write_kv_pages(*a, platform="tpu"), donate_argnums=(0, 1)).trace(
        pages, pages, new, new, sds((64,), jnp.int32)).lower(lowering_platforms=("tpu",))
    text = lowered.as_text()
    assert text.count("tpu_custom_call") == 1
    assert text.count("tf.aliasing_output") == 2  # both caches donated into the outputs
