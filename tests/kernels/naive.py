"""Deliberately naive LoRA oracles (Python loops over tokens) and the per-dtype tolerances."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# One place for tolerances: (rtol, atol as a fraction of the largest reference value).
TOLERANCES = {jnp.dtype(jnp.float32): (1e-4, 1e-5), jnp.dtype(jnp.bfloat16): (2e-2, 2e-2)}


def assert_close(got, want, dtype) -> None:
    """|got - want| <= atol + rtol * |want|, with atol scaled by max |want|."""
    rtol, atol_frac = TOLERANCES[jnp.dtype(dtype)]
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    atol = atol_frac * max(float(np.abs(want).max(initial=0.0)), 1.0)
    err = np.abs(got - want) - (atol + rtol * np.abs(want))
    worst = np.unravel_index(np.argmax(err), err.shape) if err.size else ()
    assert err.size == 0 or err.max() <= 0, f"{dtype} mismatch at {worst}: got {got[worst]}, want {want[worst]}"


def naive_shrink(x, a, slots, scalings, n_slices: int) -> np.ndarray:
    """v[t] = scaling[s] * A[s] @ x[t] for each token t with slot s >= 0, one token at a time."""
    x, a = np.asarray(x, np.float64), np.asarray(a, np.float64)
    v = np.zeros((x.shape[0], a.shape[1]))
    for t, s in enumerate(np.asarray(slots).tolist()):
        if s >= 0:
            v[t] = float(scalings[s]) * (a[s] @ x[t])
    return v


def naive_expand(v, b, base, slots) -> list[np.ndarray]:
    """y_i[t] = base_i[t] + v[t, slice i] @ B_i[s], one token at a time."""
    b = [np.asarray(bi, np.float64) for bi in b]
    rank = b[0].shape[1]
    outs = [np.array(y, np.float64) for y in base]
    for t, s in enumerate(np.asarray(slots).tolist()):
        if s < 0:
            continue
        for i, bi in enumerate(b):
            outs[i][t] += np.asarray(v[t, i * rank : (i + 1) * rank], np.float64) @ bi[s]
    return outs


def naive_lora(x, a, b, base, slots, scalings) -> list[np.ndarray]:
    """Shrink then expand, token by token."""
    return naive_expand(naive_shrink(x, a, slots, scalings, len(b)), b, base, slots)


def make_inputs(num_tokens, num_slots, rank, outs, in_features, dtype, seed, *, slots=None, ranks=None):
    """Random pool with zero-padded mixed ranks; returns numpy/jnp inputs in `dtype`."""
    rng = np.random.default_rng(seed)
    n = len(outs)
    if ranks is None:
        ranks = rng.integers(1, rank + 1, size=num_slots)
    ranks = np.asarray(ranks, np.int32)
    if slots is None:
        slots = rng.integers(-1, num_slots, size=num_tokens)
    slots = np.asarray(slots, np.int32)
    rows = (np.arange(rank)[None, :] < ranks[:, None]).astype(np.float32)
    a = rng.normal(size=(num_slots, n * rank, in_features)) * 0.3 * np.tile(rows, (1, n))[:, :, None]
    b = [rng.normal(size=(num_slots, rank, o)) * 0.3 * rows[:, :, None] for o in outs]
    x = rng.normal(size=(num_tokens, in_features))
    base = [rng.normal(size=(num_tokens, o)) for o in outs]
    scalings = rng.uniform(0.5, 2.0, size=num_slots).astype(np.float32)

    def cast(t):
        return jnp.asarray(t, dtype)

    return dict(
        x=cast(x), a=cast(a), b=tuple(cast(t) for t in b), base=tuple(cast(t) for t in base),
        slots=jnp.asarray(slots), scalings=jnp.asarray(scalings), ranks=jnp.asarray(ranks),
    )


def naive_paged_attention(q, k_pages, v_pages, block_tables, q_start, window=None) -> np.ndarray:
    """Paged attention one query and one key at a time: query c of group g at position
    p = q_start[g] + c attends to positions k <= p (and p - k < window), key k read from
    page block_tables[g, k // bs] at offset k % bs."""
    q = np.asarray(q, np.float64)
    k_pages, v_pages = np.asarray(k_pages, np.float64), np.asarray(v_pages, np.float64)
    groups, c, heads, d = q.shape
    kv_heads, _, bs, _ = k_pages.shape
    out = np.zeros_like(q)
    for g in range(groups):
        for t in range(c):
            p = int(q_start[g]) + t
            keys = [k for k in range(p + 1) if window is None or p - k < window]
            for h in range(heads):
                kh = h // (heads // kv_heads)
                scores, values = [], []
                for k in keys:
                    page, offset = int(block_tables[g][k // bs]), k % bs
                    scores.append(q[g, t, h] @ k_pages[kh, page, offset] / np.sqrt(d))
                    values.append(v_pages[kh, page, offset])
                w = np.exp(np.array(scores) - max(scores))
                out[g, t, h] = (w[:, None] * np.array(values)).sum(0) / w.sum()
    return out
