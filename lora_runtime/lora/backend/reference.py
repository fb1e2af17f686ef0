"""The plain jnp LoRA backend: gather each token's slot weights, then two einsums.

It is the CPU path and the oracle every kernel backend is tested against. Mixed
ranks need nothing special: rows past an adapter's rank are zero in the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from lora_runtime.lora.backend.base import BaseLoRABackend, select_layer
from lora_runtime.lora.batch_info import LoRABatchInfo

TENSOR_AXIS = "tensor"
_HIGHEST = jax.lax.Precision.HIGHEST


class ReferenceLoRABackend(BaseLoRABackend):
    """Gather formulation: `A[token_slots]`, masked where the slot is -1."""

    name = "reference"

    def run_lora_a_gemm(
        self,
        x: jax.Array,  # [T, in]
        a: jax.Array,  # [S, n*R, in] ([L, S, n*R, in] with layer)
        info: LoRABatchInfo,
        *,
        prefill: bool,
        parallel: str,
        layer: int | None = None,
    ) -> jax.Array:  # f32[T, n*R]
        _check_parallel(parallel)
        a = select_layer(a, layer)
        slots = info.token_slots
        used = slots >= 0
        safe = jnp.where(used, slots, 0)
        a_t = a[safe]  # [T, n*R, in]
        v = jnp.einsum("ti,tri->tr", x.astype(jnp.float32), a_t.astype(jnp.float32), precision=_HIGHEST)
        scale = jnp.where(used, info.slot_scalings[safe], 0.0)  # f32[T]
        # Row-parallel: the contraction over a sharded `in` is a partial sum; pinning v
        # replicated makes the reduction happen here, like the base layer's.
        return self._constrain(v * scale[:, None], P(None, None))

    def run_lora_b_gemm(
        self,
        v: jax.Array,  # f32[T, n*R]
        b: tuple[jax.Array, ...],  # n × [S, R, out_i] ([L, S, R, out_i] with layer)
        base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
        info: LoRABatchInfo,
        *,
        prefill: bool,
        parallel: str,
        layer: int | None = None,
    ) -> tuple[jax.Array, ...]:  # n × [T, out_i]
        _check_parallel(parallel)
        b = tuple(select_layer(b_i, layer) for b_i in b)
        if len(b) != len(base_outputs):
            raise ValueError(f"{len(b)} B slices but {len(base_outputs)} base outputs")
        slots = info.token_slots
        safe = jnp.where(slots >= 0, slots, 0)
        out_spec = P(None, TENSOR_AXIS) if parallel == "column" else P(None, None)
        outs = []
        for i, (b_i, base) in enumerate(zip(b, base_outputs)):
            r = b_i.shape[1]
            # v is already zero for slot -1 tokens, so their B rows add nothing.
            delta = jnp.einsum("tr,tro->to", v[:, i * r:(i + 1) * r], b_i[safe].astype(jnp.float32),
                               precision=_HIGHEST)
            outs.append(self._constrain(base + delta.astype(base.dtype), out_spec))
        return tuple(outs)

    def _constrain(self, x: jax.Array, spec: P) -> jax.Array:
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def _check_parallel(parallel: str) -> None:
    if parallel not in ("column", "row"):
        raise ValueError(f"{parallel=} must be 'column' or 'row'")
