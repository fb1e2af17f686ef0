"""Plain-XLA LoRA formulations: the CPU path and the baselines the kernels are measured against.

All take the pool layout of lora_runtime.lora.backend.base (A: [S, n*R, in], B_i:
[S, R, out_i]) and token_slots with -1 = no adapter.
  gather  : A[slot] and B[slot] per token, then batched mat-vecs (cost ~ T, not S)
  onehot  : one-hot(slot) einsums, what sglang-jax ships (cost ~ T * S)
  sorted  : sort tokens by slot, lax.ragged_dot per slot segment, unsort
  grouped : the U distinct slots of the step gathered once, then two dense matmuls over
            them and a per-token select (bytes ~ U adapters, FLOPs ~ T * U; no per-token
            copy of adapter weights)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

FORMULATIONS = ("gather", "onehot", "sorted", "grouped")

# The grouped formulation reads each of the step's U distinct adapters once and does
# T * U token-adapter products; the gather copies T adapters' weights (one per token)
# and does T. The grouped one is the faster on CPU once the step has at least this many
# tokens per possible adapter (T >= 4 U), and it never holds more than U adapters' weights,
# where the gather holds T: a 512-token prefill at rank 64 and Llama-3-8B widths gathers
# gigabytes per projection. Measured with benchmarks/cpu_formulations.py (4096 -> 4096,
# r=64, f32; grouped over gather): T=64: D=16 0.41, D=32 1.29; T=8: D=1 0.38, D=4 2.6;
# T=512: D=64 0.63. Sorted + ragged_dot was slowest everywhere (benchmarks/lora_kernels.py).
CPU_GROUPED_TOKENS_PER_ADAPTER = 4


def cpu_formulation(num_slots: int, num_tokens: int | None = None, num_distinct: int | None = None) -> str:
    """The XLA formulation measured fastest on CPU for `num_tokens` tokens over a pool of
    `num_slots` slots, at most `num_distinct` of them in one step (static bounds)."""
    distinct = distinct_bound(num_slots, num_tokens, num_distinct)
    tokens = num_tokens if num_tokens is not None else 1
    return "grouped" if CPU_GROUPED_TOKENS_PER_ADAPTER * distinct <= tokens else "gather"


def distinct_bound(num_slots: int, num_tokens: int | None, num_distinct: int | None = None) -> int:
    """The most distinct slots `num_tokens` tokens can use (a static bound)."""
    bound = num_slots
    for limit in (num_tokens, num_distinct):
        if limit is not None:
            bound = min(bound, limit)
    return max(bound, 1)


def step_slots(token_slots: jax.Array, num_slots: int, size: int) -> jax.Array:  # i32[size]
    """The distinct slots `token_slots` uses, ascending, padded with -1 to `size` entries
    (`size` >= the distinct count, see distinct_bound)."""
    keys = jnp.where(token_slots >= 0, token_slots, num_slots)  # no-adapter tokens: a sentinel
    distinct = jnp.unique(keys, size=min(size + 1, token_slots.shape[0]), fill_value=num_slots)
    distinct = jnp.where(distinct < num_slots, distinct, -1)
    # The sentinel sorts last, so the real slots are the first entries.
    return jnp.pad(distinct, (0, max(0, size - distinct.shape[0])), constant_values=-1)[:size]


def _group_select(token_slots: jax.Array, slots: jax.Array) -> jax.Array:  # f32[T, U]
    """One-hot of each token's slot among the step's distinct slots (zero row for -1)."""
    return ((token_slots[:, None] == slots[None, :]) & (slots[None, :] >= 0)).astype(jnp.float32)


def _grouped_slots(token_slots, num_slots, slots):
    if slots is None:
        slots = step_slots(token_slots, num_slots, distinct_bound(num_slots, token_slots.shape[0]))
    return slots, jnp.maximum(slots, 0)


def _safe(token_slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    has = token_slots >= 0
    return jnp.where(has, token_slots, 0), has


def shrink(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [S, n*R, in]
    token_slots: jax.Array,  # i32[T]
    slot_scalings: jax.Array,  # f32[S]
    formulation: str,
    slots: jax.Array | None = None,  # i32[U] grouped: the step's distinct slots (-1 pads); None: found here
) -> jax.Array:  # f32[T, n*R], scaled, zero for slot -1
    """v[t] = (x[t] @ A[slot]ᵀ) * scaling[slot]."""
    idx, has = _safe(token_slots)
    num_slots = a.shape[0]
    if formulation == "grouped":
        slots, used = _grouped_slots(token_slots, num_slots, slots)
        # One [T, in] x [in, U*n*R] matmul over the step's adapters, each read once.
        v_all = jnp.einsum("ti,uri->tur", x, a[used], preferred_element_type=jnp.float32)
        v = jnp.einsum("tur,tu->tr", v_all, _group_select(token_slots, slots))
    elif formulation == "gather":
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
    slots: jax.Array | None = None,  # i32[U] grouped: the step's distinct slots (-1 pads); None: found here
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """y_i[t] = base_i[t] + v[t, i*R:(i+1)*R] @ B_i[slot]."""
    idx, has = _safe(token_slots)
    num_slots, rank = b[0].shape[0], b[0].shape[1]
    outs = []
    if formulation == "grouped":
        slots, used = _grouped_slots(token_slots, num_slots, slots)
        select = _group_select(token_slots, slots)
    if formulation == "sorted":
        keys = jnp.where(has, token_slots, num_slots)
        order = jnp.argsort(keys, stable=True)
        sizes = jnp.bincount(keys, length=num_slots + 1)[:num_slots].astype(jnp.int32)
    for i, (bi, yi) in enumerate(zip(b, base_outputs)):
        vi = v[:, i * rank : (i + 1) * rank].astype(bi.dtype)
        if formulation == "grouped":
            # Each token's rank rows placed in its adapter's block: one [T, U*R] x [U*R, out] matmul.
            spread = (v[:, None, i * rank : (i + 1) * rank] * select[:, :, None]).astype(bi.dtype)
            d = jnp.einsum("tur,uro->to", spread, bi[used], preferred_element_type=jnp.float32)
        elif formulation == "gather":
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
    slots: jax.Array | None = None,  # i32[U] grouped: the step's distinct slots (-1 pads); None: found here
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """Shrink then expand in one formulation."""
    if formulation == "grouped" and slots is None:
        slots = step_slots(token_slots, a.shape[0], distinct_bound(a.shape[0], token_slots.shape[0]))
    v = shrink(x, a, token_slots, slot_scalings, formulation, slots)
    return expand(v, b, base_outputs, token_slots, formulation, slots)
