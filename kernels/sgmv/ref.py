"""Pure-jnp reference for SGMV: a loop over segments, each one dense matmul."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def ref_sgmv(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [S, n*R, in]
    b: tuple[jax.Array, ...],  # n × [S, R, out_i]
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    sorted_order,  # i32[T], concrete
    segment_starts,  # i32[N+1], concrete
    segment_slots,  # i32[N], concrete
    slot_scalings: jax.Array,  # f32[S]
) -> tuple[jax.Array, ...]:  # n × [T, out_i]
    """y_i[tokens of segment] += scaling * (x @ A_i[slot]ᵀ) @ B_i[slot], f32, per segment."""
    order, starts, slots = (np.asarray(t) for t in (sorted_order, segment_starts, segment_slots))
    rank = b[0].shape[1]
    outs = [y.astype(jnp.float32) for y in base_outputs]
    hi = jax.lax.Precision.HIGHEST
    for seg, slot in enumerate(slots.tolist()):
        toks = order[starts[seg] : starts[seg + 1]]
        if slot < 0 or toks.size == 0:
            continue
        xs = x[toks].astype(jnp.float32)
        for i, bi in enumerate(b):
            ai = a[slot, i * rank : (i + 1) * rank].astype(jnp.float32)
            v = jnp.dot(xs, ai.T, precision=hi) * slot_scalings[slot]
            outs[i] = outs[i].at[toks].add(jnp.dot(v, bi[slot].astype(jnp.float32), precision=hi))
    return tuple(o.astype(y.dtype) for o, y in zip(outs, base_outputs))
