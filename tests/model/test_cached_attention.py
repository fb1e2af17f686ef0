"""Attention over the KV cache (a chunk over its row, and decode) against direct computation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lora_runtime.model.llama import decode_attention, extend_attention, prefill_attention


def _random(shape, key):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("seq_len", "block"), [(24, 512), (24, 7), (24, 8)])
@pytest.mark.parametrize("start", [0, 9, 17])
def test_chunk_over_its_row_equals_the_whole_sequence(window, seq_len, block, start):
    """Tokens [start, start + n) of a sequence, attending to the row that holds tokens
    0..start-1 and themselves, get what the same tokens get in one pass over the sequence;
    block sizes that do and do not divide the row cover the clamped last block."""
    hkv, g, d, rows, row = 2, 3, 8, 3, 1
    total = min(start + 6, seq_len)
    q = _random((total, hkv, g, d), 0)
    k = _random((total, hkv, d), 1)
    v = _random((total, hkv, d), 2)
    positions = jnp.arange(total, dtype=jnp.int32)
    whole = prefill_attention(q, k, v, positions, jnp.zeros(total, jnp.int32), window)

    # The row holds the whole sequence (the chunk's K/V are written before attention);
    # the other rows and the row's tail hold noise that must not be read.
    k_cache = _random((rows, seq_len, hkv, d), 3).at[row, :total].set(k)
    v_cache = _random((rows, seq_len, hkv, d), 4).at[row, :total].set(v)
    n, pad = total - start, 3
    chunk_rows = jnp.concatenate([jnp.full(n, row, jnp.int32), jnp.full(pad, -1, jnp.int32)])
    chunk_pos = jnp.concatenate([positions[start:], jnp.zeros(pad, jnp.int32)])
    chunk_q = jnp.concatenate([q[start:], _random((pad, hkv, g, d), 5)])
    got = extend_attention(chunk_q, k_cache, v_cache, chunk_pos, chunk_rows, window, block=block)
    np.testing.assert_allclose(np.asarray(got[:n]), np.asarray(whole[start:]), rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(got)).all()  # padding tokens stay finite


def test_jits_with_the_row_and_positions_as_traced_inputs():
    q, k_cache, v_cache = _random((4, 1, 2, 8), 0), _random((2, 16, 1, 8), 1), _random((2, 16, 1, 8), 2)
    fn = jax.jit(lambda q, pos, rows: extend_attention(q, k_cache, v_cache, pos, rows, None, block=4))
    pos = jnp.array([5, 6, 7, 8], jnp.int32)
    a = fn(q, pos, jnp.array([0, 0, 0, 0], jnp.int32))
    b = fn(q, pos, jnp.array([1, 1, 1, 1], jnp.int32))
    assert not np.allclose(np.asarray(a), np.asarray(b))  # reads the row it is given


def _naive_decode(q, k_cache, v_cache, positions, window):
    """Per row, a softmax over keys 0..position (within the window), in numpy."""
    q, k_cache, v_cache = map(np.asarray, (q, k_cache, v_cache))
    out = np.zeros_like(q)
    groups = q.shape[2]
    for r, p in enumerate(np.asarray(positions)):
        lo = 0 if window is None else max(0, p - window + 1)
        k = np.repeat(k_cache[r, lo : p + 1], groups, axis=1).reshape(p + 1 - lo, -1, groups, q.shape[-1])
        v = np.repeat(v_cache[r, lo : p + 1], groups, axis=1).reshape(p + 1 - lo, -1, groups, q.shape[-1])
        s = np.einsum("kgd,skgd->kgs", q[r], k) / np.sqrt(q.shape[-1])
        w = np.exp(s - s.max(-1, keepdims=True))
        out[r] = np.einsum("kgs,skgd->kgd", w / w.sum(-1, keepdims=True), v)
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block", [512, 7, 8])
def test_decode_reads_each_row_up_to_its_position(window, block):
    rows, seq_len, hkv, g, d = 4, 24, 2, 3, 8
    q = _random((rows, hkv, g, d), 0)
    k_cache, v_cache = _random((rows, seq_len, hkv, d), 1), _random((rows, seq_len, hkv, d), 2)
    positions = jnp.array([0, 5, 23, 11], jnp.int32)
    got = decode_attention(q, k_cache, v_cache, positions, window, block=block)
    want = _naive_decode(q, k_cache, v_cache, positions, window)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_decode_reads_no_block_past_the_longest_row():
    """Keys past every row's position are never read: NaNs there leave the output finite."""
    q = _random((2, 1, 2, 8), 0)
    k_cache = _random((2, 32, 1, 8), 1).at[:, 16:].set(jnp.nan)
    v_cache = _random((2, 32, 1, 8), 2).at[:, 16:].set(jnp.nan)
    got = decode_attention(q, k_cache, v_cache, jnp.array([3, 15], jnp.int32), None, block=8)
    assert np.isfinite(np.asarray(got)).all()


@pytest.mark.parametrize("block", [512, 5])
def test_several_chunks_each_over_its_own_row(block):
    """Two sequences' chunks (in rows 2 and 0, out of order, one padded) attend each to its own
    row, as each would in one pass over its whole sequence; a padding segment stays finite."""
    from lora_runtime.model.llama import rows_extend_attention

    hkv, g, d, seq_len, c = 2, 2, 8, 20, 4
    k_cache, v_cache = _random((3, seq_len, hkv, d), 10), _random((3, seq_len, hkv, d), 11)
    q_all = _random((3, seq_len, hkv, g, d), 12)
    chunks = [(2, 9, 4), (0, 14, 3)]  # (row, start, tokens)
    q = jnp.zeros((3 * c, hkv, g, d))
    positions = jnp.zeros(3 * c, jnp.int32)
    rows = jnp.full(3 * c, -1, jnp.int32)
    for e, (row, start, n) in enumerate(chunks):
        q = q.at[e * c : e * c + n].set(q_all[row, start : start + n])
        positions = positions.at[e * c : e * c + n].set(jnp.arange(start, start + n))
        rows = rows.at[e * c : e * c + n].set(row)
    got = rows_extend_attention(q, k_cache, v_cache, positions, rows, None, sequences=3, block=block)
    assert np.isfinite(np.asarray(got)).all()
    for e, (row, start, n) in enumerate(chunks):
        total = start + n
        whole = prefill_attention(q_all[row, :total], k_cache[row, :total], v_cache[row, :total],
                                  jnp.arange(total, dtype=jnp.int32), jnp.zeros(total, jnp.int32), None)
        np.testing.assert_allclose(np.asarray(got[e * c : e * c + n]), np.asarray(whole[start:]),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("block", [8, 7, 16])
def test_blocked_prefill_equals_the_whole_score_matrix(window, block):
    """Past `block` tokens, packed prefill reads keys in blocks; each sequence's tokens get
    what one [T, T] score matrix gives them (block sizes that do and do not divide T)."""
    hkv, g, d = 2, 2, 8
    lengths = [11, 17, 6]  # three sequences back to back, then 6 padding tokens
    t = sum(lengths) + 6
    rows = jnp.concatenate([jnp.full(n, r, jnp.int32) for r, n in enumerate(lengths)] + [jnp.full(6, -1, jnp.int32)])
    positions = jnp.concatenate([jnp.arange(n, dtype=jnp.int32) for n in lengths] + [jnp.zeros(6, jnp.int32)])
    q, k, v = _random((t, hkv, g, d), 20), _random((t, hkv, d), 21), _random((t, hkv, d), 22)
    dense = prefill_attention(q, k, v, positions, rows, window, block=t)
    blocked = prefill_attention(q, k, v, positions, rows, window, block=block)
    real = np.asarray(rows) >= 0
    np.testing.assert_allclose(np.asarray(blocked)[real], np.asarray(dense)[real], rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(blocked)).all()
