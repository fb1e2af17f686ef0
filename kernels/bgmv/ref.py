"""Pure-jnp reference for the BGMV ops: a per-token gather, written for clarity."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ref_bgmv_shrink(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [S, n*R, in]
    token_slots: jax.Array,  # i32[T], -1 = no adapter
    slot_scalings: jax.Array,  # f32[S]
) -> jax.Array:  # f32[T, n*R]
    """v[t] = (x[t] @ A[slot[t]]ᵀ) * scaling[slot[t]]; zero for slot -1."""
    has = token_slots >= 0
    idx = jnp.where(has, token_slots, 0)
    v = jnp.einsum(
        "ti,tri->tr", x.astype(jnp.float32), a[idx].astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    return jnp.where(has[:, None], v * slot_scalings[idx][:, None], 0.0)


def ref_bgmv_expand(
    v: jax.Array,  # f32[T, n*R]
    b: tuple[jax.Array, ...],  # n × [S, R, out_i]
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    token_slots: jax.Array,  # i32[T]
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """y_i[t] = base_i[t] + v[t, i*R:(i+1)*R] @ B_i[slot[t]]; unchanged for slot -1."""
    has = token_slots >= 0
    idx = jnp.where(has, token_slots, 0)
    rank = b[0].shape[1]
    outs = []
    for i, (bi, yi) in enumerate(zip(b, base_outputs)):
        d = jnp.einsum(
            "tr,tro->to", v[:, i * rank : (i + 1) * rank].astype(jnp.float32),
            bi[idx].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST,
        )
        outs.append(jnp.where(has[:, None], yi.astype(jnp.float32) + d, yi.astype(jnp.float32)).astype(yi.dtype))
    return tuple(outs)


def ref_bgmv(x, a, b, base_outputs, token_slots, slot_scalings):
    """Shrink then expand (f32 throughout)."""
    v = ref_bgmv_shrink(x, a, token_slots, slot_scalings)
    return ref_bgmv_expand(v, b, base_outputs, token_slots)
