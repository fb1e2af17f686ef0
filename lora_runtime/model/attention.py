"""Attention of one layer over the paged cache: writing K/V, and reading them per step mode.

A prefill step of fresh sequences attends among its own tokens (nothing is in the cache
yet); every other step reads pages through kernels/paged_attention, inside shard_map
over the tensor axis for the Pallas kernels (XLA partitions its own formulation).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels.paged_attention import paged_attention
from kernels.paged_attention.write import write_kv_pages
from kernels.paged_attention.xla import MASK_VALUE, online_softmax, online_softmax_step
from lora_runtime.model.kv_cache import AttentionMetadata

TENSOR_AXIS = "tensor"


def _window_ok(delta: jax.Array, window: int | None) -> jax.Array:
    """Key within the sliding window: ``delta`` = query position - key position."""
    return jnp.ones_like(delta, bool) if window is None else delta < window


def prefill_attention(
    q: jax.Array,  # [T, Hkv, G, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    positions: jax.Array,  # i32[T]
    token_seq: jax.Array,  # i32[T], -1 = padding
    window: int | None,
    block: int = 512,
) -> jax.Array:  # [T, Hkv, G, D]
    """Causal attention among the packed fresh sequences of one prefill step.

    Up to `block` tokens, one [T, T] score matrix per head; past that, keys in blocks with an
    online softmax, so a large prefill budget needs [T, block] scores, not [T, T].
    """
    t = token_seq.shape[0]
    scale = 1.0 / math.sqrt(q.shape[-1])
    if t <= block:
        same = (token_seq[:, None] == token_seq[None, :]) & (token_seq[:, None] >= 0)
        delta = positions[:, None] - positions[None, :]
        # The diagonal keeps padding rows finite; real tokens always see themselves anyway.
        mask = (same & (delta >= 0) & _window_ok(delta, window)) | jnp.eye(t, dtype=bool)
        scores = jnp.einsum("tkgd,skd->kgts", q, k, preferred_element_type=jnp.float32) * scale
        probs = jax.nn.softmax(jnp.where(mask, scores, MASK_VALUE), axis=-1)
        return jnp.einsum("kgts,skd->tkgd", probs.astype(v.dtype), v)

    q_seq = jnp.where(token_seq >= 0, token_seq, -2)  # padding matches no key: its output is 0

    def body(i, carry):
        start = i * block
        first = jnp.minimum(start, t - block)  # the last block is clamped; earlier keys masked
        kb = jax.lax.dynamic_slice_in_dim(k, first, block)
        vb = jax.lax.dynamic_slice_in_dim(v, first, block)
        k_pos = jax.lax.dynamic_slice_in_dim(positions, first, block)
        k_seq = jax.lax.dynamic_slice_in_dim(token_seq, first, block)
        delta = positions[:, None] - k_pos[None, :]  # [T, block]
        mask = (((first + jnp.arange(block)) >= start)[None, :] & (q_seq[:, None] == k_seq[None, :])
                & (delta >= 0) & _window_ok(delta, window))
        s = jnp.einsum("tkgd,skd->kgts", q, kb, preferred_element_type=jnp.float32) * scale
        return online_softmax_step(carry, s, mask, vb, "kgts,skd->kgtd")

    _, hkv, g, d = q.shape
    out = online_softmax(body, 0, -(-t // block), (hkv, g, t), d)
    return jnp.transpose(out, (2, 0, 1, 3)).astype(v.dtype)


def write_kv(
    k_pages: jax.Array,  # [Hkv, N, bs, Dp]: Dp >= D (kv_cache.py)
    v_pages: jax.Array,  # [Hkv, N, bs, Dp]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]: block * bs + offset; out of range: dropped
    *,
    platform: str = "xla",
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Writes each token's K/V at its slot; padding tokens (slot past the cache) write nothing.
    `platform` "tpu" writes both through one Mosaic kernel, any other through an XLA scatter
    each (kernels/paged_attention/write.py)."""
    write = "tpu" if platform == "tpu" else "xla"
    k, v = to_page_width(k, k_pages.shape[-1]), to_page_width(v, v_pages.shape[-1])

    def both(k_pages, v_pages, k, v, slot_mapping):
        return write_kv_pages(k_pages, v_pages, k, v, slot_mapping, platform=write, interpret=interpret)

    if _tensor_parallel():
        # Each device writes its own kv heads: a kernel sees one device's pages, and XLA's
        # partitioner would gather the (head, slot)-indexed scatter's operands across devices.
        pages_spec, new_spec = P(TENSOR_AXIS, None, None, None), P(None, TENSOR_AXIS, None)
        both = jax.shard_map(both, in_specs=(pages_spec, pages_spec, new_spec, new_spec, P()),
                             out_specs=(pages_spec, pages_spec), check_vma=False)
    return both(k_pages, v_pages, k, v, slot_mapping)


def to_page_width(x: jax.Array, width: int) -> jax.Array:
    """`x` [..., D] padded with zeros to a cache page's last dim `width` (KVCache.create)."""
    pad = width - x.shape[-1]
    if pad < 0:
        raise ValueError(f"head_dim {x.shape[-1]} is wider than the cache's pages ({width})")
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x


def _tensor_parallel() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.shape.get(TENSOR_AXIS, 1) > 1


def paged_layer_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, bs, Dp >= D], this step's K/V already written
    v_pages: jax.Array,  # [Hkv, N, bs, Dp]
    positions: jax.Array,  # i32[T]
    attn: AttentionMetadata,
    window: int | None,
) -> jax.Array:  # [T, Hq, D]
    """Each group of C queries reads its sequence's pages up to its positions (see AttentionMetadata)."""
    t, heads, d = q.shape
    groups = attn.block_tables.shape[0]
    c = t // groups
    if groups * c != t:
        raise ValueError(f"{t} tokens do not split into {groups} groups of equal size")
    q_start = positions.reshape(groups, c)[:, 0]
    # Pages wider than the heads (a TPU cache's whole lane tiles) hold zeros past d: a query
    # padded with zeros scores the same, and the output's columns past d are dropped.
    fn = functools.partial(paged_attention, sm_scale=1.0 / math.sqrt(d), window=window, platform=attn.platform,
                           interpret=attn.interpret)
    qg = to_page_width(q, k_pages.shape[-1]).reshape(groups, c, heads, -1)
    if _tensor_parallel():
        # A Pallas kernel sees one device's heads, and the XLA formulation's (head, page)-indexed
        # gather would be gathered across devices: shard_map over the heads of q and the pages.
        heads_spec, pages_spec = P(None, None, TENSOR_AXIS, None), P(TENSOR_AXIS, None, None, None)
        fn = jax.shard_map(fn, in_specs=(heads_spec, pages_spec, pages_spec, P(), P()), out_specs=heads_spec,
                           check_vma=False)
    return fn(qg, k_pages, v_pages, attn.block_tables, q_start)[..., :d].reshape(t, heads, d)
