"""Input checks for the LoRA kernels: shapes and dtypes (static), slot and rank values (dynamic)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lora_runtime.errors import InvalidAdapterError


def static_validate_shrink(
    x: jax.Array,  # [T, in]
    a: jax.Array,  # [S, n*R, in]
    n_slices: int,
    token_slots: jax.Array,  # i32[T]
    slot_scalings: jax.Array,  # f32[S]
    slot_ranks: jax.Array,  # i32[S]
) -> None:
    """Shape/dtype checks that hold under tracing (no values read)."""
    if x.ndim != 2:
        raise ValueError(f"x must be [T, in], got shape {x.shape}")
    if a.ndim != 3:
        raise ValueError(f"A must be [S, n*R, in], got shape {a.shape}")
    if n_slices < 1 or a.shape[1] % n_slices:
        raise ValueError(f"A rank axis {a.shape[1]} is not a multiple of {n_slices=}")
    if a.shape[2] != x.shape[1]:
        raise ValueError(f"A in-features {a.shape[2]} != x in-features {x.shape[1]}")
    if a.dtype != x.dtype:
        raise ValueError(f"A dtype {a.dtype} != x dtype {x.dtype}")
    _check_slot_arrays(x.shape[0], a.shape[0], token_slots, slot_scalings, slot_ranks)


def static_validate_expand(
    v: jax.Array,  # f32[T, n*R]
    b: tuple[jax.Array, ...],  # n × [S, R, out_i]
    base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
    token_slots: jax.Array,
    slot_scalings: jax.Array,
    slot_ranks: jax.Array,
) -> None:
    """Shape/dtype checks for the expand."""
    if not isinstance(b, tuple) or not isinstance(base_outputs, tuple):
        raise ValueError(f"B and base_outputs must be tuples, got {type(b).__name__} and {type(base_outputs).__name__}")
    if not b or len(b) != len(base_outputs):
        raise ValueError(f"{len(b)} B slices but {len(base_outputs)} base outputs")
    num_slots, rank = b[0].shape[0], b[0].shape[1]
    if v.ndim != 2 or v.shape[1] != len(b) * rank:
        raise ValueError(f"v shape {v.shape} does not match {len(b)} slices of rank {rank}")
    for i, (bi, yi) in enumerate(zip(b, base_outputs)):
        if bi.ndim != 3 or bi.shape[:2] != (num_slots, rank):
            raise ValueError(f"B[{i}] shape {bi.shape} is not [{num_slots}, {rank}, out]")
        if yi.shape != (v.shape[0], bi.shape[2]):
            raise ValueError(f"base output {i} shape {yi.shape} != {(v.shape[0], bi.shape[2])}")
        if bi.dtype != b[0].dtype:
            raise ValueError(f"B[{i}] dtype {bi.dtype} != B[0] dtype {b[0].dtype}")
    _check_slot_arrays(v.shape[0], num_slots, token_slots, slot_scalings, slot_ranks)


def static_validate_inputs(x, a, b, base_outputs, token_slots, slot_scalings, slot_ranks) -> None:
    """All static checks of the fused op."""
    static_validate_shrink(x, a, len(b), token_slots, slot_scalings, slot_ranks)
    v_aval = jax.ShapeDtypeStruct((x.shape[0], a.shape[1]), jnp.float32)
    static_validate_expand(v_aval, b, base_outputs, token_slots, slot_scalings, slot_ranks)
    if b[0].shape[0] != a.shape[0] or b[0].shape[1] * len(b) != a.shape[1]:
        raise ValueError(f"A shape {a.shape} and B[0] shape {b[0].shape} disagree on slots or rank")
    if b[0].dtype != a.dtype:
        raise ValueError(f"B dtype {b[0].dtype} != A dtype {a.dtype}")


def _check_slot_arrays(num_tokens, num_slots, token_slots, slot_scalings, slot_ranks) -> None:
    if token_slots.shape != (num_tokens,) or not jnp.issubdtype(token_slots.dtype, jnp.integer):
        raise ValueError(f"token_slots must be int[{num_tokens}], got {token_slots.dtype}{list(token_slots.shape)}")
    if slot_scalings.shape != (num_slots,):
        raise ValueError(f"slot_scalings must be [{num_slots}], got shape {slot_scalings.shape}")
    if slot_ranks.shape != (num_slots,):
        raise ValueError(f"slot_ranks must be [{num_slots}], got shape {slot_ranks.shape}")


def dynamic_validate_inputs(
    token_slots,  # i32[T], concrete
    slot_ranks,  # i32[S], concrete
    max_lora_rank: int,
) -> None:
    """Value checks on concrete (host) arrays: slots in [-1, S), ranks in [0, R]."""
    slots = np.asarray(token_slots)
    ranks = np.asarray(slot_ranks)
    num_slots = ranks.shape[0]
    bad = slots[(slots < -1) | (slots >= num_slots)]
    if bad.size:
        raise ValueError(f"token slot {int(bad[0])} outside [-1, {num_slots})")
    for slot, rank in enumerate(ranks.tolist()):
        if rank < 0 or rank > max_lora_rank:
            raise InvalidAdapterError(f"{rank=} of {slot=} outside [0, {max_lora_rank=}]")
