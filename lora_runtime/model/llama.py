"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) in Flax NNX, with a KV cache and a LoRA hook.

Module and parameter names mirror Hugging Face's (``layers.self_attn.q_proj.kernel[i]``,
or ``layers[i].self_attn.q_proj.kernel`` with the layers unrolled, is
``model.layers.{i}.self_attn.q_proj.weight`` transposed), so the loader maps one to the
other by name. Linear kernels are stored ``[in, out]``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lora_runtime.model.activations import activation
from lora_runtime.model.attention import paged_layer_attention, prefill_attention, write_kv
from lora_runtime.model.kv_cache import AttentionMetadata, KVCache, layer_pages, layer_slots
from lora_runtime.model.config import ModelConfig, RopeScaling
from lora_runtime.model.lora_hook import LoRAHook

_INIT_STD = 0.02


class Linear(nnx.Module):
    """y = x @ kernel (+ bias), kernel stored [in, out]."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: str, rngs: nnx.Rngs):
        normal = jax.random.normal
        self.kernel = nnx.Param(_INIT_STD * normal(rngs.params(), (in_features, out_features), dtype))
        self.bias = nnx.Param(_INIT_STD * normal(rngs.params(), (out_features,), dtype)) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, in] -> [T, out]
        y = x @ self.kernel[...]
        return y if self.bias is None else y + self.bias[...]


class RMSNorm(nnx.Module):
    """RMS normalisation over the last axis, computed in f32 like Hugging Face's."""

    def __init__(self, dim: int, *, eps: float, dtype: str):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim]
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:  # f32[head_dim // 2]
    """RoPE inverse frequencies, with the config's linear, llama3 or yarn scaling applied.

    "dynamic" scaling gets plain RoPE: transformers' frequencies for sequences up to
    max_position_embeddings, the longest an engine may run for such a model.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(config.rope_theta, dim, scaling)
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(base: float, dim: int, scaling: RopeScaling) -> np.ndarray:  # f32[dim // 2]
    """YaRN, as transformers' ``_compute_yarn_parameters``: frequencies that turn fewer than
    ``beta_slow`` times over the original context are divided by the factor, those turning
    more than ``beta_fast`` times kept, with a linear ramp between."""
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        """The (fractional) dimension index that turns ``rotations`` times over ``original``."""
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # weight of the unscaled frequency
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    return (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)


def rope_attention_factor(config: ModelConfig) -> float:
    """What cos and sin are multiplied by: yarn's attention factor, else 1."""
    scaling = config.rope_scaling
    return 1.0 if scaling is None else scaling.attention_factor


def apply_rope(
    x: jax.Array,  # [T, N, D]
    positions: jax.Array,  # i32[T]
    inv_freq: np.ndarray,  # f32[D // 2]
    attention_factor: float,
) -> jax.Array:  # [T, N, D]
    """Rotates the two halves of each head (Hugging Face's rotate_half layout), scaled by
    ``attention_factor`` as transformers scales cos and sin."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, D/2]
    cos = (jnp.cos(angles) * attention_factor)[:, None, :]
    sin = (jnp.sin(angles) * attention_factor)[:, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, optional q/k norm and sliding window."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = Linear(c.hidden_size, q_out, bias=c.attention_bias, dtype=c.dtype, rngs=rngs)
        self.k_proj = Linear(c.hidden_size, kv_out, bias=c.attention_bias, dtype=c.dtype, rngs=rngs)
        self.v_proj = Linear(c.hidden_size, kv_out, bias=c.attention_bias, dtype=c.dtype, rngs=rngs)
        self.o_proj = Linear(q_out, c.hidden_size, bias=c.attention_out_bias, dtype=c.dtype, rngs=rngs)
        self.q_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps, dtype=c.dtype) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps, dtype=c.dtype) if c.qk_norm else None

    def __call__(
        self,
        h: jax.Array,  # [T, H]
        positions: jax.Array,  # i32[T]
        kv: KVCache,  # every layer's pages (kv_cache.py)
        attn: AttentionMetadata,
        lora: LoRAHook | None,
        layer: jax.Array | int,  # this layer's index (traced inside the layer loop)
        window: int | None,  # this layer's sliding window
    ) -> tuple[jax.Array, KVCache]:  # [T, H], the cache with this layer's K/V written
        c, t = self.config, h.shape[0]
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        if lora is not None:
            q, k, v = lora("qkv", layer, h, (q, k, v))
        # The projections stay [T, out] rows: folded into the reshape to heads, XLA's TPU
        # layouts wanted each layer's q/k/v kernel transposed, and copied it (sliced out of the
        # layer stack, then relaid) on every step, about 1 ms of a 5.4 ms 8-layer Llama-3-8B
        # decode step on TPU v5e (benchmarks/step_profile.py). Laying out the small [T, out]
        # rows anew costs next to nothing.
        q, k, v = jax.lax.optimization_barrier((q, k, v))
        q = q.reshape(t, c.num_heads, c.head_dim)
        k = k.reshape(t, c.num_kv_heads, c.head_dim)
        v = v.reshape(t, c.num_kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq, rope_scale = rope_inv_freq(c), rope_attention_factor(c)
        q, k = apply_rope(q, positions, inv_freq, rope_scale), apply_rope(k, positions, inv_freq, rope_scale)

        n = kv.num_blocks
        slots = layer_slots(attn.slot_mapping, layer, n, kv.block_size, kv.num_layers)
        k_pages, v_pages = write_kv(kv.k, kv.v, k, v, slots, platform=attn.platform, interpret=attn.interpret)
        kv = dataclasses.replace(kv, k=k_pages, v=v_pages)
        if attn.mode == "prefill":
            groups = c.num_heads // c.num_kv_heads
            out = prefill_attention(q.reshape(t, c.num_kv_heads, groups, c.head_dim), k, v, positions,
                                    attn.token_seq, window)
        else:
            pages = dataclasses.replace(attn, block_tables=layer_pages(attn.block_tables, layer, n))
            out = paged_layer_attention(q, k_pages, v_pages, positions, pages, window)
        out = out.reshape(t, c.num_heads * c.head_dim)
        o = self.o_proj(out)
        if lora is not None:
            (o,) = lora("o", layer, out, (o,))
        return o, kv


class MLP(nnx.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), act = silu (SwiGLU) unless the
    checkpoint's hidden_act names another."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, dtype=c.dtype, rngs=rngs)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, dtype=c.dtype, rngs=rngs)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias, dtype=c.dtype, rngs=rngs)
        self.hidden_act = c.hidden_act

    def __call__(self, h: jax.Array, lora: LoRAHook | None, layer: jax.Array | int) -> jax.Array:  # [T, H] -> [T, H]
        g, u = self.gate_proj(h), self.up_proj(h)
        if lora is not None:
            g, u = lora("gate_up", layer, h, (g, u))
        act = activation(self.hidden_act)(g) * u
        d = self.down_proj(act)
        if lora is not None:
            (d,) = lora("down", layer, act, (d,))
        return d


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP blocks with residuals."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=c.dtype)
        self.self_attn = Attention(c, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=c.dtype)
        self.mlp = MLP(c, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,  # [T, H]
        positions: jax.Array,  # i32[T]
        kv: KVCache,
        attn: AttentionMetadata,
        lora: LoRAHook | None,
        layer: jax.Array | int,
        window: int | None,
    ) -> tuple[jax.Array, KVCache]:
        a, kv = self.self_attn(self.input_layernorm(x), positions, kv, attn, lora, layer, window)
        x = x + a
        x = x + self.mlp(self.post_attention_layernorm(x), lora, layer)
        return x, kv


def layer_runs(config: ModelConfig) -> list[tuple[int, int, int | None]]:
    """The layers as maximal runs [start, end) of one sliding window each: (start, end, window)."""
    runs: list[tuple[int, int, int | None]] = []
    for i in range(config.num_layers):
        window = config.layer_window(i)
        if runs and runs[-1][2] == window:
            runs[-1] = (runs[-1][0], i + 1, window)
        else:
            runs.append((i, i + 1, window))
    return runs


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """One DecoderLayer whose every parameter holds the given layers' values stacked on a
    leading axis (layer i at index i)."""
    graphdef, _ = nnx.split(layers[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.state(layer) for layer in layers))
    return nnx.merge(graphdef, stacked)


class LlamaModel(nnx.Module):
    """The decoder stack plus embeddings and lm_head; one call runs one prefill or decode step.

    With `scan_layers` (the default) the layers are one DecoderLayer whose parameters are
    stacked over layers ([L, ...]), run as a loop (one per run of equal sliding window), so
    a step's program and its compile time do not grow with depth; the layer index is traced
    and the LoRA kernels and the paged cache read that layer in place. Without it, `layers`
    is a list of per-layer modules, unrolled in the program: XLA on CPU copies each layer's
    weights out of a stack inside a loop (a loop step reads them twice), which separate
    arrays avoid, at a compile time that grows with depth.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, scan_layers: bool = True):
        c = config
        self.config = c
        self.scan_layers = scan_layers
        self.embed_tokens = nnx.Embed(
            c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=c.dtype, rngs=rngs
        )
        layers = [DecoderLayer(c, rngs=rngs) for _ in range(c.num_layers)]
        self.layers = stack_layers(layers) if scan_layers else nnx.List(layers)
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=c.dtype)
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else Linear(c.hidden_size, c.vocab_size, bias=False, dtype=c.dtype, rngs=rngs)
        )

    def __call__(
        self,
        tokens: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        kv_cache: KVCache,
        attn: AttentionMetadata,
        lora: LoRAHook | None = None,
    ) -> tuple[jax.Array, KVCache]:  # hidden [T, H] after the final norm, updated cache
        """Runs every layer on T tokens, writing their K/V into the cache."""
        # Clipped lookup: a padding id out of range must not turn into NaN and leak into
        # other tokens through attention.
        x = jnp.take(self.embed_tokens.embedding[...], tokens, axis=0, mode="clip")
        embed = getattr(lora, "embed", None)  # optional: hooks may adapt the projections only
        if embed is not None:
            x = embed(tokens, x)
        if not self.scan_layers:
            for i, layer in enumerate(self.layers):
                x, kv_cache = layer(x, positions, kv_cache, attn, lora, i, self.config.layer_window(i))
            return self.norm(x), kv_cache
        graphdef, params = nnx.split(self.layers)
        for start, end, window in layer_runs(self.config):
            def body(i, carry, window=window):
                x, kv = carry
                layer = nnx.merge(graphdef, jax.tree.map(lambda p: p[i], params))
                return layer(x, positions, kv, attn, lora, i, window)

            x, kv_cache = jax.lax.fori_loop(start, end, body, (x, kv_cache))
        return self.norm(x), kv_cache

    def linear(self, layer: int, module: str) -> tuple[jax.Array, jax.Array | None]:
        """Layer `layer`'s projection `module` (q_proj .. down_proj): its kernel [in, out] and bias."""
        block = self.layers if self.scan_layers else self.layers[layer]
        part = block.self_attn if module in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp
        linear = getattr(part, module)
        kernel, bias = linear.kernel[...], None if linear.bias is None else linear.bias[...]
        if self.scan_layers:
            kernel, bias = kernel[layer], None if bias is None else bias[layer]
        return kernel, bias

    def logits(self, hidden: jax.Array, lora: LoRAHook | None = None,
               rows: jax.Array | None = None) -> jax.Array:  # [N, H] -> f32[N, V]
        """Vocabulary logits in f32; with `lora`, each row's lm_head adapter added (row i is
        the step's token rows[i], or token i when rows is None)."""
        if self.lm_head is None:
            embedding = self.embed_tokens.embedding[...]
            logits = jnp.einsum("nh,vh->nv", hidden, embedding, preferred_element_type=jnp.float32)
        else:
            logits = jnp.dot(hidden, self.lm_head.kernel[...], preferred_element_type=jnp.float32)
        head = getattr(lora, "head", None)
        return logits if head is None else head(hidden, logits, rows)
