"""The seam between the base model and the LoRA runtime.

The model knows nothing about pools, slots or kernels. At every target projection
group it hands the group's input and its base outputs to an optional ``LoRAHook``,
which returns the outputs with each token's own adapter added:

    y_i[t] = base_i[t] + scale[slot[t]] * (x[t] @ A_i[slot[t]]ᵀ) @ B_i[slot[t]]ᵀ

A hook may also adapt the token embedding (an `embed` method, after the lookup) and the
output head (`head`, on the f32 logits), for adapters that target embed_tokens or lm_head;
the model calls them where the hook has them (a plain function hook adapts projections only).

Groups and their slices (in this order):
    "qkv"     x: [T, hidden]          slices (q, k, v)      column-parallel
    "o"       x: [T, heads*head_dim]  slices (o,)           row-parallel
    "gate_up" x: [T, hidden]          slices (gate, up)     column-parallel
    "down"    x: [T, intermediate]    slices (down,)        row-parallel
"""

from __future__ import annotations

from typing import Protocol

import jax

GROUPS: tuple[str, ...] = ("qkv", "o", "gate_up", "down")
GROUP_SLICES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoRAHook(Protocol):
    """Adds per-token adapter deltas to the base outputs of one projection group."""

    def __call__(
        self,
        group: str,
        layer: int,
        x: jax.Array,  # [T, in]
        base_outputs: tuple[jax.Array, ...],  # each [T, out_i]
    ) -> tuple[jax.Array, ...]:  # each [T, out_i]
        ...

    def embed(
        self,
        tokens: jax.Array,  # i32[T]
        x: jax.Array,  # [T, hidden]: the base embeddings
    ) -> jax.Array:  # [T, hidden]
        ...

    def head(
        self,
        hidden: jax.Array,  # [N, hidden]
        logits: jax.Array,  # f32[N, vocab]: the base logits
        rows: jax.Array | None = None,  # i32[N]: the step's token of each row (None: row i is token i)
    ) -> jax.Array:  # f32[N, vocab]
        ...
