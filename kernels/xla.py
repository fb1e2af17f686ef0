"""Plain-XLA LoRA formulations: the CPU path and the baselines the kernels are measured against.

All take the pool layout of lora_runtime.lora.backend.base (A: [S, n*R, in], B_i:
[S, R, out_i]) and token_slots with -1 = no adapter.
  gather  : A[slot] and B[slot] per token, then batched mat-vecs (cost ~ T, not S)
  onehot  : one-hot(slot) einsums, what sglang-jax ships (cost ~ T * S)
  sorted  : sort tokens by slot, lax.ragged_dot per slot segment, unsort
  grouped : the U distinct slots of the step gathered once, then two dense matmuls over
            them and a per-token select (bytes ~ U adapters, FLOPs ~ T * U; no per-token
            copy of adapter weights)
  loop    : a loop over the distinct slots the step really uses (a dynamic trip count),
            each adapter read in place once and applied to its tokens (bytes ~ D adapters)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

FORMULATIONS = ("gather", "onehot", "sorted", "grouped", "loop")

# The formulation the CPU path runs: the loop over the adapters a step really uses reads
# each once in place, where the gather copies one adapter's weights per token. Measured
# with benchmarks/cpu_formulations.py (4096 -> 4096, r=64, f32, ms): T=64, D=16: loop 11.9,
# grouped 30.2, gather 53.0; T=8, D=1: 0.43 / 0.64 / 1.16; T=512, D=64: 276 / 312 / 412;
# its worst cases are within 1.5x of the best (T=8, D=8 gather 1.54, loop 2.08; T=512, D=4
# grouped 15.0, loop 22.5). On Llama-3-8B projection groups at T=9 (a decode step) it was
# 2-3x faster than the gather with 8 adapters and 10-20x with 1. Sorted + ragged_dot was
# slowest everywhere (benchmarks/lora_kernels.py).
CPU_FORMULATION = "loop"


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
    slots = jnp.asarray(slots)
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
    layer: jax.Array | None = None,  # i32[1]: a is stacked over layers ([L, S, n*R, in]); apply this one
) -> jax.Array:  # f32[T, n*R], scaled, zero for slot -1
    """v[t] = (x[t] @ A[slot]ᵀ) * scaling[slot]."""
    idx, has = _safe(token_slots)
    if layer is not None and formulation != "loop":
        a, layer = _layer(a, layer), None
    num_slots = a.shape[0] if layer is None else a.shape[1]
    if formulation == "loop":
        slots, _ = _grouped_slots(token_slots, num_slots, slots)
        token_slots = jnp.asarray(token_slots)

        def add_adapter(i, v):
            s = slots[i]
            a_s = _slot(a, layer, s)  # [n*R, in], read in place
            mine = (token_slots == s).astype(jnp.float32)[:, None]
            return v + mine * jnp.einsum("ti,ri->tr", x, a_s, preferred_element_type=jnp.float32)

        v = lax.fori_loop(0, jnp.sum(slots >= 0), add_adapter, jnp.zeros((x.shape[0], a.shape[-2]), jnp.float32))
    elif formulation == "grouped":
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
    layer: jax.Array | None = None,  # i32[1]: each B_i is stacked over layers ([L, S, R, out_i])
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """y_i[t] = base_i[t] + v[t, i*R:(i+1)*R] @ B_i[slot]."""
    idx, has = _safe(token_slots)
    if formulation == "loop":
        num_slots = b[0].shape[0 if layer is None else 1]
        return _expand_loop(v, b, base_outputs, token_slots, _grouped_slots(token_slots, num_slots, slots)[0], layer)
    if layer is not None:
        b = tuple(_layer(bi, layer) for bi in b)
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


def _layer(arr: jax.Array, layer: jax.Array) -> jax.Array:
    """One layer of a stacked pool array (formulations that read all of its slots)."""
    return lax.dynamic_index_in_dim(arr, layer[0], 0, keepdims=False)


def _slot(arr: jax.Array, layer: jax.Array | None, slot: jax.Array) -> jax.Array:
    """One slot's weights, sliced straight out of the (stacked) pool: inside a loop, a layer
    slice taken first would be copied whole."""
    if layer is not None:
        return lax.dynamic_slice(arr, (layer[0], slot) + (0,) * (arr.ndim - 2), (1, 1) + arr.shape[2:])[0, 0]
    return lax.dynamic_index_in_dim(arr, slot, 0, keepdims=False)


def _expand_loop(v, b, base_outputs, token_slots, slots, layer=None):
    """The loop formulation's expand: each distinct slot's B read in place once."""
    rank = b[0].shape[-2]
    token_slots = jnp.asarray(token_slots)

    def add_adapter(i, ds):
        s = slots[i]
        mine = (token_slots == s).astype(jnp.float32)[:, None]
        out = []
        for j, (bj, dj) in enumerate(zip(b, ds)):
            b_s = _slot(bj, layer, s)  # [R, out_j]
            vj = (v[:, j * rank : (j + 1) * rank] * mine).astype(bj.dtype)
            out.append(dj + jnp.einsum("tr,ro->to", vj, b_s, preferred_element_type=jnp.float32))
        return tuple(out)

    zeros = tuple(jnp.zeros((v.shape[0], bj.shape[-1]), jnp.float32) for bj in b)
    ds = lax.fori_loop(0, jnp.sum(slots >= 0), add_adapter, zeros)
    return tuple((y.astype(jnp.float32) + d).astype(y.dtype) for y, d in zip(base_outputs, ds))


def lora(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [S, n*R, in]
    b: tuple[jax.Array, ...],  # n × [S, R, out_i]
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    token_slots: jax.Array,  # i32[T]
    slot_scalings: jax.Array,  # f32[S]
    formulation: str,
    slots: jax.Array | None = None,  # i32[U] grouped: the step's distinct slots (-1 pads); None: found here
    layer: jax.Array | None = None,  # i32[1]: the pool is stacked over layers; apply this one
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """Shrink then expand in one formulation."""
    num_slots = a.shape[0 if layer is None else 1]
    if formulation in ("grouped", "loop") and slots is None:
        slots = step_slots(token_slots, num_slots, distinct_bound(num_slots, token_slots.shape[0]))
    v = shrink(x, a, token_slots, slot_scalings, formulation, slots, layer)
    return expand(v, b, base_outputs, token_slots, formulation, slots, layer)
