"""A layer's attention over the paged cache (chunks, several sequences, decode) against the
same tokens computed in one pass over each whole sequence; K/V writes; the Pallas kernels
under tensor parallelism."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from lora_runtime.model.attention import paged_layer_attention, prefill_attention, write_kv
from lora_runtime.model.kv_cache import AttentionMetadata
from lora_runtime.model.sharding import make_mesh
from tests.helpers.paged import RowPages

HKV, G, D = 2, 3, 8


def _random(shape, key):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _pages_holding(pages: RowPages, seqs: dict[int, tuple[jax.Array, jax.Array]], noise_key: int):
    """K/V pages full of noise, with row r's sequence (k, v: [n, Hkv, D]) written at its slots."""
    shape = (HKV, pages.num_blocks, pages.block_size, D)
    k_pages, v_pages = _random(shape, noise_key), _random(shape, noise_key + 1)
    for row, (k, v) in seqs.items():
        slots = jnp.asarray(pages.slots(np.full(len(k), row), np.arange(len(k))))
        k_pages, v_pages = write_kv(k_pages, v_pages, k, v, slots)
    return k_pages, v_pages


def _whole(q, k, v, window):
    n = q.shape[0]
    out = prefill_attention(q.reshape(n, HKV, G, D), k, v, jnp.arange(n, dtype=jnp.int32),
                            jnp.zeros(n, jnp.int32), window)
    return out.reshape(n, HKV * G, D)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("start", [0, 9, 17])
@pytest.mark.parametrize("block_size", [4, 16])
def test_chunk_over_its_pages_equals_the_whole_sequence(window, start, block_size):
    """Tokens [start, start + n) of a sequence, reading its pages (which hold tokens 0..start-1
    and, written first, the chunk's own), get what one pass over the sequence gives them; other
    rows' pages and the row's tail hold noise that must not be read."""
    pages = RowPages(3, 24, block_size, seed=start)
    row, total, pad = 1, min(start + 6, 24), 3
    q, k, v = _random((total, HKV * G, D), 0), _random((total, HKV, D), 1), _random((total, HKV, D), 2)
    k_pages, v_pages = _pages_holding(pages, {row: (k, v)}, 3)
    n = total - start
    rows = np.r_[np.full(n, row), np.full(pad, -1)]
    positions = np.r_[np.arange(start, total), np.zeros(pad, int)]
    chunk_q = jnp.concatenate([q[start:], _random((pad, HKV * G, D), 5)])
    got = paged_layer_attention(chunk_q, k_pages, v_pages, jnp.asarray(positions, jnp.int32),
                                pages.paged(rows, positions, 1), window)
    np.testing.assert_allclose(np.asarray(got[:n]), np.asarray(_whole(q, k, v, window)[start:]), rtol=1e-5,
                               atol=1e-5)
    assert np.isfinite(np.asarray(got)).all()  # padding tokens stay finite


def test_several_groups_each_over_its_own_pages():
    """Chunks of two sequences (rows 2 and 0, out of order, one padded) and an idle group: each
    chunk attends to its own row's pages only."""
    pages, c = RowPages(3, 20, 4, seed=7), 4
    seqs = {row: (_random((20, HKV, D), 10 + row), _random((20, HKV, D), 20 + row)) for row in (0, 2)}
    q_all = {row: _random((20, HKV * G, D), 30 + row) for row in (0, 2)}
    k_pages, v_pages = _pages_holding(pages, seqs, 40)
    chunks = [(2, 9, 4), (0, 14, 3)]  # (row, start, tokens); a third group is idle
    q = jnp.zeros((3 * c, HKV * G, D))
    positions, rows = np.zeros(3 * c, np.int32), np.full(3 * c, -1)
    for e, (row, start, n) in enumerate(chunks):
        q = q.at[e * c:e * c + n].set(q_all[row][start:start + n])
        positions[e * c:e * c + c] = np.arange(start, start + c)
        rows[e * c:e * c + n] = row
    got = paged_layer_attention(q, k_pages, v_pages, jnp.asarray(positions), pages.paged(rows, positions, 3), None)
    assert np.isfinite(np.asarray(got)).all()
    for e, (row, start, n) in enumerate(chunks):
        k, v = seqs[row]
        whole = _whole(q_all[row][:start + n], k[:start + n], v[:start + n], None)
        np.testing.assert_allclose(np.asarray(got[e * c:e * c + n]), np.asarray(whole[start:]), rtol=1e-5,
                                   atol=1e-5)


def test_decode_reads_only_its_own_pages():
    """Blocks outside every running row's table are NaN, and a table lists only the blocks up
    to its row's position (the rest point at the null block), as the engine's do: decode
    stays finite and equals the whole-sequence pass."""
    pages = RowPages(2, 32, 8, seed=3)
    positions = np.array([3, 15], np.int32)
    shape = (HKV, pages.num_blocks, 8, D)
    k_pages, v_pages = jnp.full(shape, jnp.nan), jnp.full(shape, jnp.nan)
    k_pages, v_pages = k_pages.at[:, 0].set(0.0), v_pages.at[:, 0].set(0.0)  # the null block
    tables = np.zeros((2, 4), np.int32)
    seqs = {}
    for row, p in enumerate(positions):
        seqs[row] = (_random((p + 1, HKV, D), 50 + row), _random((p + 1, HKV, D), 60 + row))
        for b in range(p // 8 + 1):
            page = tables[row, b] = pages.tables[row, b]
            # Stale, finite data past the position in the row's last block.
            k_pages = k_pages.at[:, page].set(_random((HKV, 8, D), 70 + 2 * b + row))
            v_pages = v_pages.at[:, page].set(_random((HKV, 8, D), 80 + 2 * b + row))
        slots = jnp.asarray(pages.slots(np.full(p + 1, row), np.arange(p + 1)))
        k_pages, v_pages = write_kv(k_pages, v_pages, *seqs[row], slots)
    q = _random((2, HKV * G, D), 0)
    attn = AttentionMetadata(slot_mapping=jnp.full(2, pages.num_blocks * 8, jnp.int32),
                             block_tables=jnp.asarray(tables), mode="paged")
    got = paged_layer_attention(q, k_pages, v_pages, jnp.asarray(positions), attn, None)
    assert np.isfinite(np.asarray(got)).all()
    for row, p in enumerate(positions):
        q_all = jnp.concatenate([_random((p, HKV * G, D), 90), q[row:row + 1]])
        np.testing.assert_allclose(np.asarray(got[row]), np.asarray(_whole(q_all, *seqs[row], None)[p]),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform", ["xla", "tpu"])
def test_pages_wider_than_the_heads_read_as_the_heads_own(platform):
    """A TPU cache pads heads to whole 128-lane tiles (kernels.common.page_head_dim): K/V
    written into pages 128 wide get zeros past D, and a chunk and a decode step reading them
    get what pages D wide give, whatever the columns past D hold (the TPU kernels interpreted)."""
    pages = RowPages(3, 24, 8, seed=11)
    row, total, width = 1, 20, 128
    q, k, v = _random((total, HKV * G, D), 0), _random((total, HKV, D), 1), _random((total, HKV, D), 2)
    narrow = _pages_holding(pages, {row: (k, v)}, 3)
    shape = (HKV, pages.num_blocks, pages.block_size, width)
    slots = jnp.asarray(pages.slots(np.full(total, row), np.arange(total)))
    wide = write_kv(_random(shape, 3), _random(shape, 4), k, v, slots, platform=platform, interpret=True)
    written = np.asarray(wide[0]).reshape(HKV, -1, width)[:, np.asarray(slots)]
    np.testing.assert_array_equal(written[..., :D], np.swapaxes(np.asarray(k), 0, 1))
    assert not written[..., D:].any()  # the padding is written as zeros
    wide = tuple(p.at[..., D:].set(_random(p[..., D:].shape, 6 + i)) for i, p in enumerate(wide))
    for start, n in ((12, 8), (19, 1)):  # a chunk over cached positions, then a decode step
        rows, positions = np.full(n, row), np.arange(start, start + n)
        attn = pages.paged(rows, positions, 1)
        want = paged_layer_attention(q[start:start + n], *narrow, jnp.asarray(positions, jnp.int32), attn, None)
        attn = pages.paged(rows, positions, 1, platform=platform, interpret=True)
        got = paged_layer_attention(q[start:start + n], *wide, jnp.asarray(positions, jnp.int32), attn, None)
        assert got.shape == (n, HKV * G, D)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_write_kv_writes_its_slots_and_drops_padding():
    k_pages = jnp.zeros((HKV, 4, 2, D))
    k = _random((3, HKV, D), 0)
    slots = jnp.asarray([5, 2, 8], jnp.int32)  # 8 = past the cache: padding
    got, _ = write_kv(k_pages, k_pages, k, k, slots)
    flat = np.asarray(got).reshape(HKV, 8, D)
    np.testing.assert_array_equal(flat[:, 5], np.asarray(k[0]))
    np.testing.assert_array_equal(flat[:, 2], np.asarray(k[1]))
    assert np.count_nonzero(np.abs(flat).sum(-1)) == 2 * HKV


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_kernels_under_tensor_parallelism_equal_xla(platform):
    """The Pallas kernels (interpret mode) run per device inside shard_map over 2 devices'
    heads and give what the XLA formulation gives."""
    mesh = make_mesh(2)
    pages = RowPages(3, 16, 4, seed=5)
    seqs = {row: (_random((16, HKV, D), 70 + row), _random((16, HKV, D), 80 + row)) for row in range(3)}
    k_pages, v_pages = _pages_holding(pages, seqs, 90)
    q = _random((3, HKV * G, D), 1)
    positions = jnp.asarray([4, 15, 9], jnp.int32)
    rows = [0, 1, 2]

    def run(platform):
        attn = pages.decode(rows, positions, platform=platform, interpret=True)
        heads, kv = NamedSharding(mesh, P(None, "tensor", None)), NamedSharding(mesh, P("tensor"))
        with jax.set_mesh(mesh):
            fn = jax.jit(lambda q, k, v, a: paged_layer_attention(q, k, v, positions, a, None))
            return fn(jax.device_put(q, heads), jax.device_put(k_pages, kv), jax.device_put(v_pages, kv), attn)

    np.testing.assert_allclose(np.asarray(run(platform)), np.asarray(run("xla")), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("block", [8, 7, 16])
def test_blocked_prefill_equals_the_whole_score_matrix(window, block):
    """Past `block` tokens, packed prefill reads keys in blocks; each sequence's tokens get
    what one [T, T] score matrix gives them (block sizes that do and do not divide T)."""
    lengths = [11, 17, 6]  # three sequences back to back, then 6 padding tokens
    t = sum(lengths) + 6
    seq = jnp.concatenate([jnp.full(n, r, jnp.int32) for r, n in enumerate(lengths)] + [jnp.full(6, -1, jnp.int32)])
    positions = jnp.concatenate([jnp.arange(n, dtype=jnp.int32) for n in lengths] + [jnp.zeros(6, jnp.int32)])
    q, k, v = _random((t, HKV, G, D), 20), _random((t, HKV, D), 21), _random((t, HKV, D), 22)
    dense = prefill_attention(q, k, v, positions, seq, window, block=t)
    blocked = prefill_attention(q, k, v, positions, seq, window, block=block)
    real = np.asarray(seq) >= 0
    np.testing.assert_allclose(np.asarray(blocked)[real], np.asarray(dense)[real], rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(blocked)).all()


@pytest.mark.parametrize("tp", [2, 4])
def test_cache_write_and_xla_read_stay_on_each_devices_heads(tp):
    """Under tensor parallelism each device writes and reads its own kv heads: the compiled
    write and XLA page read gather nothing across devices and copy no cache (their (head,
    slot) and (head, page) indices would otherwise be partitioned by gathering the cache)."""
    heads, blocks, bs, d, t = 8, 8192, 16, 128, 64  # the read gathers 64 x 8 pages of K and V: 1/8 of it
    mesh = make_mesh(tp)
    sds = jax.ShapeDtypeStruct
    pages = sds((heads, blocks, bs, d), jnp.float32, sharding=NamedSharding(mesh, P("tensor", None, None, None)))
    new = sds((t, heads, d), jnp.float32, sharding=NamedSharding(mesh, P(None, "tensor", None)))
    rows = sds((t,), jnp.int32, sharding=NamedSharding(mesh, P()))
    q = sds((t, 4 * heads, d), jnp.float32, sharding=NamedSharding(mesh, P(None, "tensor", None)))
    tables = sds((t, 8), jnp.int32, sharding=NamedSharding(mesh, P()))
    per_device = heads * blocks * bs * d * 4 // tp

    def read(q, k_pages, v_pages, tables, positions):
        attn = AttentionMetadata(slot_mapping=positions, block_tables=tables, mode="paged", platform="xla")
        return paged_layer_attention(q, k_pages, v_pages, positions, attn, None)

    with jax.set_mesh(mesh):
        write = jax.jit(write_kv, donate_argnums=(0, 1)).lower(pages, pages, new, new, rows).compile()
        paged = jax.jit(read).lower(q, pages, pages, tables, rows).compile()
    for compiled in (write, paged):
        assert "all-gather" not in compiled.as_text()
        assert compiled.memory_analysis().temp_size_in_bytes < per_device // 4
