"""The LoRA hook seam of LlamaModel: which groups it sees, with what, and where its outputs go."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lora_runtime.model.config import ModelConfig, RopeScaling
from lora_runtime.model.lora_hook import GROUP_SLICES
from lora_runtime.model.llama import LlamaModel, apply_rope, layer_runs, rope_attention_factor, rope_inv_freq
from lora_runtime.model.sharding import make_mesh
from tests.helpers.paged import RowPages

# Qwen3-like: q/k norm and a head_dim that is not hidden / heads, plus qkv bias, so the
# test sees the hook's place relative to bias, norm and RoPE.
CONFIG = ModelConfig(
    architecture="qwen3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    attention_bias=True,
    qk_norm=True,
    sliding_window=None,
    dtype="float32",
    bos_token_id=None,
    eos_token_ids=(),
)
TOKENS = jnp.asarray([3, 9, 27, 4, 8], jnp.int32)
POSITIONS = jnp.asarray([0, 1, 2, 0, 1], jnp.int32)
PAGES = RowPages(2, 8)
ATTN = PAGES.prefill([0, 0, 0, 1, 1], POSITIONS)


def run(model, lora=None) -> np.ndarray:
    cache = PAGES.cache(CONFIG, make_mesh(1))
    hidden, _ = model(TOKENS, POSITIONS, cache, ATTN, lora)
    return np.asarray(hidden)


def test_hook_sees_every_group_in_order_with_flat_shapes():
    """Unrolled, the hook sees each layer's groups in order with that layer's index."""
    calls = []

    def hook(group, layer, x, base_outputs):
        calls.append((group, layer, x.shape, tuple(y.shape for y in base_outputs)))
        return base_outputs

    model = LlamaModel(CONFIG, rngs=nnx.Rngs(0), scan_layers=False)
    np.testing.assert_array_equal(run(model, hook), run(model))
    t, q, kv, mlp = 5, 4 * 16, 2 * 16, 48
    per_layer = [
        ("qkv", (t, 32), ((t, q), (t, kv), (t, kv))),
        ("o", (t, q), ((t, 32),)),
        ("gate_up", (t, 32), ((t, mlp), (t, mlp))),
        ("down", (t, mlp), ((t, 32),)),
    ]
    assert calls == [(g, i, x, outs) for i in range(2) for g, x, outs in per_layer]

    # As a loop over stacked layers, the hook is traced once, with the layer index traced.
    calls.clear()
    np.testing.assert_allclose(run(LlamaModel(CONFIG, rngs=nnx.Rngs(0)), hook), run(model), rtol=1e-5, atol=1e-5)
    assert [(g, x, outs) for g, _, x, outs in calls] == per_layer
    assert all(isinstance(layer, jax.core.Tracer) and layer.dtype == jnp.int32 for _, layer, _, _ in calls)


def add_deltas(model, deltas) -> None:
    """Adds deltas[(layer, module)] to that projection's kernel, stacked or unrolled."""
    for (i, name), delta in deltas.items():
        block = model.layers if model.scan_layers else model.layers[i]
        owner = block.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp
        kernel = getattr(owner, name).kernel
        kernel[...] = kernel[...].at[i].add(delta) if model.scan_layers else kernel[...] + delta


@pytest.mark.parametrize("scan_layers", [True, False])
def test_hook_delta_equals_a_kernel_change(scan_layers):
    """Adding x @ D in the hook must equal adding D to that projection's kernel, for all seven."""
    model = LlamaModel(CONFIG, rngs=nnx.Rngs(0), scan_layers=scan_layers)
    rng = np.random.default_rng(0)
    deltas = {}
    for i in range(CONFIG.num_layers):
        for group, names in GROUP_SLICES.items():
            for name in names:
                shape = model.linear(i, name)[0].shape
                deltas[(i, name)] = jnp.asarray(0.05 * rng.standard_normal(shape), jnp.float32)
    stacked = {name: jnp.stack([deltas[(i, name)] for i in range(CONFIG.num_layers)])
               for names in GROUP_SLICES.values() for name in names}

    def hook(group, layer, x, base_outputs):  # layer: an int unrolled, traced in the loop
        return tuple(y + x @ stacked[n][layer] for y, n in zip(base_outputs, GROUP_SLICES[group]))

    changed = nnx.clone(model)
    add_deltas(changed, deltas)
    with_hook, reference, base = run(model, hook), run(changed), run(model)
    np.testing.assert_allclose(with_hook, reference, rtol=1e-5, atol=1e-5)
    assert np.abs(with_hook - base).max() > 1e-2  # the deltas matter


def test_stacked_layers_equal_unrolled_ones():
    """The loop over stacked layers computes what the unrolled layers do, prefill and decode,
    also with layers in runs of different sliding windows (one loop per run), and writes the
    same K/V into every layer's pages."""
    mesh = make_mesh(1)
    for config in (CONFIG, dataclasses.replace(CONFIG, num_layers=4, sliding_window=2,
                                               sliding_layers=(False, True, True, False))):
        assert len(layer_runs(config)) == (1 if config is CONFIG else 3)
        stacked = LlamaModel(config, rngs=nnx.Rngs(0))
        unrolled = LlamaModel(config, rngs=nnx.Rngs(0), scan_layers=False)
        for i in range(config.num_layers):
            np.testing.assert_array_equal(stacked.linear(i, "down_proj")[0], unrolled.linear(i, "down_proj")[0])
        pages = RowPages(1, 8, block_size=2)
        outs = []
        for model in (stacked, unrolled):
            run = jax.jit(lambda *args, model=model: model(*args))  # one program a step, not an op at a time
            cache = pages.cache(config, mesh)
            prompt = jnp.asarray([5, 6, 7, 8, 9], jnp.int32)
            _, cache = run(prompt[:4], jnp.arange(4, dtype=jnp.int32), cache,
                           pages.prefill(np.zeros(4, np.int32), np.arange(4)))
            hidden, cache = run(prompt[4:], jnp.asarray([4], jnp.int32), cache, pages.decode([0], [4]))
            outs.append((np.asarray(hidden), np.asarray(cache.k), np.asarray(cache.v)))
        for a, b in zip(*outs):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        per_layer = outs[0][1].reshape(config.num_kv_heads, config.num_layers, -1)
        assert (np.abs(per_layer).sum(axis=(0, 2)) > 0).all()  # every layer wrote its own pages


def with_rope(config: ModelConfig, rope: dict) -> ModelConfig:
    scaling = RopeScaling.from_hf_dict(rope, max_position_embeddings=config.max_position_embeddings)
    return dataclasses.replace(config, rope_scaling=scaling)


def test_rope_llama3_scaling_by_hand():
    """Long wavelengths are divided by the factor, short ones kept, the middle blended."""
    scaling = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    )
    config = with_rope(CONFIG, scaling)
    plain = rope_inv_freq(CONFIG)
    scaled = rope_inv_freq(config)
    wavelen = 2 * np.pi / plain
    short, long = wavelen < 64 / 4, wavelen > 64 / 1
    assert short.any() and long.any() and (~short & ~long).any()
    np.testing.assert_allclose(scaled[short], plain[short])
    np.testing.assert_allclose(scaled[long], plain[long] / 8)
    middle = ~short & ~long
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8)).all()
    linear = with_rope(CONFIG, dict(type="linear", factor=2.0))
    np.testing.assert_allclose(rope_inv_freq(linear), plain / 2)


def test_rope_yarn_scaling_by_hand():
    """Over a 64-token original context (head_dim 16, theta 1e4) dimension 0 turns more than
    beta_fast=32 times and is kept, dimensions from 3 on turn less than beta_slow=1 times and
    are divided by the factor; 1 and 2 are blended. cos and sin carry the attention factor."""
    rope = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    config = with_rope(CONFIG, rope)
    plain, yarn = rope_inv_freq(CONFIG), rope_inv_freq(config)
    np.testing.assert_allclose(yarn[0], plain[0], rtol=1e-6)
    np.testing.assert_allclose(yarn[3:], plain[3:] / 4, rtol=1e-6)
    assert ((yarn[1:3] < plain[1:3]) & (yarn[1:3] > plain[1:3] / 4)).all()
    # Untruncated, the ramp runs over dimensions 0 to 2.02 instead of 0 to 3: 1 and 2 are scaled more.
    untruncated = rope_inv_freq(with_rope(CONFIG, dict(rope, truncate=False)))
    assert (untruncated[1:3] < yarn[1:3]).all()
    np.testing.assert_array_equal(untruncated[[0, *range(3, 8)]], yarn[[0, *range(3, 8)]])
    assert rope_attention_factor(config) == pytest.approx(1 + 0.1 * math.log(4))
    assert rope_attention_factor(CONFIG) == 1.0
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 2, 16)), jnp.float32)
    positions = jnp.arange(3, dtype=jnp.int32)
    np.testing.assert_allclose(
        np.asarray(apply_rope(x, positions, plain, 1.5)), 1.5 * np.asarray(apply_rope(x, positions, plain, 1.0)),
        rtol=1e-6, atol=1e-6,
    )


@pytest.mark.parametrize(
    "head_dim, theta, rope",
    [
        (16, 500.0, dict(factor=4.0, original_max_position_embeddings=32)),
        (32, 1e4, dict(factor=8.0, original_max_position_embeddings=32, truncate=False, beta_slow=2.5)),
        (64, 1e6, dict(factor=4.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.707)),
        (128, 1e6, dict(factor=None, original_max_position_embeddings=32, attention_factor=0.9)),
    ],
)
def test_rope_yarn_matches_transformers(head_dim, theta, rope):
    """Frequencies and attention factor against transformers' own computation."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=128,
        rope_theta=theta, rope_scaling=dict(rope_type="yarn", **rope),
    )
    hf_inv_freq, hf_attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    config = dataclasses.replace(CONFIG, head_dim=head_dim, rope_theta=theta, max_position_embeddings=128)
    config = with_rope(config, dict(rope_type="yarn", **rope))
    np.testing.assert_allclose(rope_inv_freq(config), hf_inv_freq.numpy(), rtol=1e-6)
    assert rope_attention_factor(config) == pytest.approx(hf_attention_factor, rel=1e-12)


def test_sliding_window_limits_what_decode_sees():
    """With a 2-token window, a decode token's output ignores what lies further back."""
    config = dataclasses.replace(CONFIG, sliding_window=2)
    model = LlamaModel(config, rngs=nnx.Rngs(0))
    mesh = make_mesh(1)

    def last_hidden(prompt):
        pages = RowPages(1, 8, block_size=2)
        cache = pages.cache(config, mesh)
        n = len(prompt)
        attn = pages.prefill(np.zeros(n - 1, np.int32), np.arange(n - 1))
        _, cache = model(jnp.asarray(prompt[:-1], jnp.int32), jnp.arange(n - 1, dtype=jnp.int32), cache, attn)
        decode = pages.decode([0], [n - 1])
        hidden, _ = model(jnp.asarray(prompt[-1:], jnp.int32), jnp.asarray([n - 1], jnp.int32), cache, decode)
        return np.asarray(hidden)

    # Two layers with window 2: the last token reaches positions 2..4 only.
    a, b = last_hidden([5, 6, 7, 8, 9]), last_hidden([50, 6, 7, 8, 9])
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    c = last_hidden([5, 6, 70, 8, 9])
    assert np.abs(a - c).max() > 1e-3
    assert np.isfinite(a).all()
