"""The paged KVCache: layout and sharding, where each step writes K/V, and a jitted forward that donates the cache."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lora_runtime.model.kv_cache import AttentionMetadata, KVCache, block_bytes
from lora_runtime.model.config import ModelConfig
from lora_runtime.model.llama import LlamaModel
from lora_runtime.model.sharding import make_mesh, shard_model
from tests.helpers.paged import RowPages

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    head_dim=8,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    attention_bias=False,
    qk_norm=False,
    sliding_window=None,
    dtype="float32",
    bos_token_id=1,
    eos_token_ids=(2,),
)
ROWS, MAX_SEQ, BS = 4, 16, 4
PAGES = RowPages(ROWS, MAX_SEQ, BS, seed=1)


def i32(x) -> jax.Array:
    return jnp.asarray(x, jnp.int32)


@pytest.mark.parametrize("tp", [1, 4])
def test_create_shapes_and_sharding(tp):
    mesh = make_mesh(tp)
    cache = KVCache.create(CONFIG, 9, BS, mesh)
    assert cache.num_layers == CONFIG.num_layers == 2
    assert (cache.num_blocks, cache.block_size) == (9, BS)
    for a in cache.arrays:  # both layers' pages in one array, layer 1's from page 9
        assert a.shape == (4, 2 * 9, BS, 8) and a.dtype == jnp.float32
        assert a.sharding.spec == P("tensor", None, None, None)
        assert {s.data.shape for s in a.addressable_shards} == {(4 // tp, 2 * 9, BS, 8)}
        assert not np.asarray(a).any()
        assert cache.layer(a, 1).shape == (4, 9, BS, 8)
    assert cache.bytes_per_block == block_bytes(CONFIG, BS) == 2 * 2 * 4 * 8 * BS * 4
    assert cache.nbytes == 9 * cache.bytes_per_block


def test_bf16_cache_and_pytree():
    cache = KVCache.create(dataclasses.replace(CONFIG, dtype="bfloat16"), 3, 8, make_mesh(1))
    assert cache.k.dtype == jnp.bfloat16 and cache.bytes_per_block == 2 * 2 * 4 * 8 * 8 * 2
    leaves, treedef = jax.tree.flatten(cache)
    assert len(leaves) == 2 and jax.tree.unflatten(treedef, leaves) == cache


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_blocks=1 must be >= 2"):
        KVCache.create(CONFIG, 1, 8, make_mesh(1))
    with pytest.raises(ValueError, match="'chunked'"):
        AttentionMetadata(slot_mapping=i32([0]), token_seq=i32([0]), mode="chunked")
    with pytest.raises(ValueError, match="needs block_tables"):
        AttentionMetadata(slot_mapping=i32([0]), mode="paged")
    with pytest.raises(ValueError, match="tensor_parallel_size=8 exceeds the 4"):
        make_mesh(8)


@pytest.fixture(scope="module")
def model():
    return LlamaModel(CONFIG, rngs=nnx.Rngs(0))


def written(cache: KVCache, layer: int = 0) -> np.ndarray:  # bool[rows, max_seq_len]: where a layer holds K
    held = np.abs(np.asarray(cache.layer(cache.k, layer))).sum(axis=(0, 3)) > 0  # [blocks, bs]
    positions = np.arange(MAX_SEQ)
    return held[PAGES.tables[:, positions // BS], positions % BS]


def test_prefill_writes_rows_and_positions_but_not_padding(model):
    cache = PAGES.cache(CONFIG, make_mesh(1))
    # Padding tokens (row -1) carry an out-of-vocabulary id: outputs must stay finite.
    tokens = i32([5, 6, 7, 8, 9, 999, -5])
    positions = i32([0, 1, 2, 0, 1, 3, 4])
    attn = PAGES.prefill([3, 3, 3, 1, 1, -1, -1], positions)
    hidden, cache = model(tokens, positions, cache, attn)
    assert np.isfinite(np.asarray(hidden)).all()
    expected = np.zeros((ROWS, MAX_SEQ), bool)
    expected[3, :3] = expected[1, :2] = True
    for layer in range(CONFIG.num_layers):  # each layer its own pages; padding in none
        np.testing.assert_array_equal(written(cache, layer), expected)


def test_decode_writes_one_position_per_active_row(model):
    cache = PAGES.cache(CONFIG, make_mesh(1))
    attn = PAGES.decode([0, -1, 2, -1], [4, 9, 0, 3])
    hidden, cache = model(i32([5, 6, 7, 8]), i32([4, 9, 0, 3]), cache, attn)
    assert hidden.shape == (ROWS, CONFIG.hidden_size) and np.isfinite(np.asarray(hidden)).all()
    expected = np.zeros((ROWS, MAX_SEQ), bool)
    expected[0, 4] = expected[2, 0] = True
    for layer in range(CONFIG.num_layers):
        np.testing.assert_array_equal(written(cache, layer), expected)
    with pytest.raises(ValueError, match="3 tokens do not split into 2 groups"):
        uneven = AttentionMetadata(slot_mapping=i32([0, 1, 2]), block_tables=i32(PAGES.tables[:2]), mode="paged")
        model(i32([1, 2, 3]), i32([0, 0, 0]), cache, uneven)


def replicating_hook(mesh):
    """A LoRA hook that adds nothing but hands back replicated outputs."""
    replicated = NamedSharding(mesh, P())

    def hook(group, layer, x, base_outputs):
        return tuple(jax.lax.with_sharding_constraint(y, replicated) for y in base_outputs)

    return hook


def make_step(mesh, lora=None):
    """The engine's step: a model with the same weights as ``model``, sharded, split/merged under jit."""
    sharded = LlamaModel(CONFIG, rngs=nnx.Rngs(0))
    shard_model(sharded, mesh)
    graphdef, state = nnx.split(sharded)

    @functools.partial(jax.jit, donate_argnums=(3,))
    def step(state, tokens, positions, cache, attn):
        m = nnx.merge(graphdef, state)
        hidden, cache = m(tokens, positions, cache, attn, lora)
        return m.logits(hidden), cache

    return functools.partial(step, state)


@pytest.mark.parametrize("tp", [1, 4])
def test_jitted_forward_donates_the_cache(model, tp):
    """The engine's step: split/merge under jit, cache donated and updated in place."""
    mesh = make_mesh(tp)
    step = make_step(mesh)

    tokens, positions = i32([3, 4, 5, 6, 7]), i32([0, 1, 2, 0, 1])
    attn = PAGES.prefill([0, 0, 0, 2, 2], positions)
    eager_logits, eager_cache = model(tokens, positions, PAGES.cache(CONFIG, mesh), attn)
    eager_logits = model.logits(eager_logits)

    cache = PAGES.cache(CONFIG, mesh)
    donated = cache.k
    logits, cache = step(tokens, positions, cache, attn)
    assert donated.is_deleted()
    np.testing.assert_allclose(np.asarray(logits), np.asarray(eager_logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(cache.k), np.asarray(eager_cache.k), rtol=1e-5, atol=1e-6)
    expected = NamedSharding(mesh, P("tensor", None, None, None))
    assert cache.k.sharding.is_equivalent_to(expected, 4), cache.k.sharding

    # A decode step reuses the donated result as its input.
    before = cache.v
    attn = PAGES.decode([0, -1, 2, -1], [3, 0, 2, 0])
    logits, cache = step(i32([8, 0, 9, 0]), i32([3, 0, 2, 0]), cache, attn)
    assert before.is_deleted() and logits.shape == (ROWS, CONFIG.vocab_size) and logits.dtype == jnp.float32
    assert written(cache)[0, :4].all() and written(cache)[2, :3].all() and not written(cache)[1].any()


def test_cache_keeps_its_sharding_whatever_the_hook_returns(model):
    """The donated cache must come back in its own layout, or the next step cannot alias it."""
    mesh = make_mesh(4)
    step = make_step(mesh, lora=replicating_hook(mesh))
    cache = PAGES.cache(CONFIG, mesh)
    donated = cache.v
    attn = PAGES.prefill([1, 1, -1], [0, 1, 0])
    logits, cache = step(i32([3, 4, 0]), i32([0, 1, 0]), cache, attn)
    assert donated.is_deleted()
    expected = NamedSharding(mesh, P("tensor", None, None, None))
    assert all(a.sharding.is_equivalent_to(expected, 4) for a in cache.arrays)
    ref, _ = model(i32([3, 4, 0]), i32([0, 1, 0]), PAGES.cache(CONFIG, make_mesh(1)), attn)
    np.testing.assert_allclose(np.asarray(logits)[:2], np.asarray(model.logits(ref))[:2], rtol=1e-5, atol=1e-5)
