"""Plain-XLA LoRA formulations: the CPU path and the baselines the kernels are measured against.

All take the pool layout of lora_runtime.lora.backend.base (A: [S, n*R, in], B_i:
[S, R, out_i]) and token_slots with -1 = no adapter.
  gather  : A[slot] and B[slot] per token, then batched mat-vecs (cost ~ T, not S)
  onehot  : one-hot(slot) einsums, what sglang-jax ships (cost ~ T * S)
  sorted  : sort tokens by slot, lax.ragged_dot per slot segment, unsort
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

FORMULATIONS = ("gather", "onehot", "sorted")

# Up to this many slots the one-hot einsum's dense matmuls beat the gather on CPU; past
# it the gather's cost (independent of S) wins. Measured with benchmarks/lora_kernels.py
# (f32, r=16): S=4..8 one-hot 1.1-12x faster than gather, S=64 gather 2.5x faster;
# sorted + ragged_dot was slowest everywhere.
CPU_ONEHOT_MAX_SLOTS = 16


def cpu_formulation(num_slots: int) -> str:
    """The XLA formulation measured fastest on CPU for a pool of `num_slots` slots."""
    return "onehot" if num_slots <= CPU_ONEHOT_MAX_SLOTS else "gather"


def _safe(token_slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    has = token_slots >= 0
    return jnp.where(has, token_slots, 0), has


def shrink(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [S, n*R, in]
    token_slots: jax.Array,  # i32[T]
    slot_scalings: jax.Array,  # f32[S]
    formulation: str,
) -> jax.Array:  # f32[T, n*R], scaled, zero for slot -1
    """v[t] = (x[t] @ A[slot]ᵀ) * scaling[slot]."""
    idx, has = _safe(token_slots)
    num_slots = a.shape[0]
    if formulation == "gather":
        v = jnp.einsum("ti,tri->tr", x, a[idx], preferred_element_type=jnp.float32)
    elif formulation == "onehot":
        oh = jax.nn.one_hot(token_slots, num_slots, dtype=x.dtype)  # -1 gives a zero row
        v = jnp.einsum("ti,ts,sri->tr", x, oh, a, preferred_element_type=jnp.float32)
    elif formulation == "sorted":
        keys = jnp.where(has, token_slots, num_slots)
        order = jnp.argsort(keys, stable=True)
        sizes = jnp.bincount(keys, length=num_slots + 1)[:num_slots].astype(jnp.int32)
        vs = lax.ragged_dot(x[order], jnp.swapaxes(a, 1, 2), sizes, preferred_element_type=jnp.float32)
        v = jnp.zeros_like(vs).at[order].set(vs)
    else:
        raise ValueError(f"{formulation=} is not one of {FORMULATIONS}")
    scale = jnp.where(has, slot_scalings[idx], 0.0)
    return v * scale[:, None]


def expand(
    v: jax.Array,  # f32[T, n*R] scaled
    b: tuple[jax.Array, ...],  # n × [S, R, out_i]
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    token_slots: jax.Array,  # i32[T]
    formulation: str,
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """y_i[t] = base_i[t] + v[t, i*R:(i+1)*R] @ B_i[slot]."""
    idx, has = _safe(token_slots)
    num_slots, rank = b[0].shape[0], b[0].shape[1]
    outs = []
    if formulation == "sorted":
        keys = jnp.where(has, token_slots, num_slots)
        order = jnp.argsort(keys, stable=True)
        sizes = jnp.bincount(keys, length=num_slots + 1)[:num_slots].astype(jnp.int32)
    for i, (bi, yi) in enumerate(zip(b, base_outputs)):
        vi = v[:, i * rank : (i + 1) * rank].astype(bi.dtype)
        if formulation == "gather":
            d = jnp.einsum("tr,tro->to", vi, bi[idx], preferred_element_type=jnp.float32)
        elif formulation == "onehot":
            oh = jax.nn.one_hot(token_slots, num_slots, dtype=bi.dtype)
            d = jnp.einsum("tr,ts,sro->to", vi, oh, bi, preferred_element_type=jnp.float32)
        elif formulation == "sorted":
            ds = lax.ragged_dot(vi[order], bi, sizes, preferred_element_type=jnp.float32)
            d = jnp.zeros_like(ds).at[order].set(ds)
        else:
            raise ValueError(f"{formulation=} is not one of {FORMULATIONS}")
        d = jnp.where(has[:, None], d, 0.0)
        outs.append((yi.astype(jnp.float32) + d).astype(yi.dtype))
    return tuple(outs)


def lora(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [S, n*R, in]
    b: tuple[jax.Array, ...],  # n × [S, R, out_i]
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    token_slots: jax.Array,  # i32[T]
    slot_scalings: jax.Array,  # f32[S]
    formulation: str,
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """Shrink then expand in one formulation."""
    v = shrink(x, a, token_slots, slot_scalings, formulation)
    return expand(v, b, base_outputs, token_slots, formulation)
