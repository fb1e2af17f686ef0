"""The LoRA backend interface: how a jitted step applies each token's adapter.

Pool layout (one layer, one projection group; decided once, shared by all backends
and kernels):
    A: [S, n_slices * R, in]          the group's shrink weights, slices stacked on rank
    B: tuple of n_slices [S, R, out_i] the expand weights of each slice
S slots of rank R (one rank class of the pool, lora_runtime/lora/memory_pool.py: the hook
calls a backend once per class with that class's arrays and a view of the step's metadata
in which only the class's tokens have a slot); an adapter of rank r < R fills rows [0, r)
of each slice and leaves the rest zero, so padded rows contribute nothing. Every method also takes
`layer`: when given, A and B are the whole pool stacked over layers (A [L, S, n*R, in],
B_i [L, S, R, out_i], as LoRAMemoryPool holds them) and the method applies that layer;
the kernels read it in place, so no layer slice is copied out of the stack.

Tensor parallelism: with a mesh whose "tensor" axis has size N > 1, a column-parallel
group (qkv, gate_up) has x and A replicated and each B_i and y_i sharded on out; a
row-parallel group (o, down) has x and A sharded on in, so the shrink is a partial sum
reduced over the tensor axis, and B and y replicated. Each call says which with
`parallel` ("column" or "row"); backends use it to place or shard_map their work.

Semantics, for every token t with s = token_slots[t] >= 0 (tokens with s == -1 are
left unchanged):
    v[t]      = (x[t] @ A[s]ᵀ) * slot_scalings[s]                   run_lora_a_gemm
    y_i[t]   += v[t, i*R:(i+1)*R] @ B_i[s]                           run_lora_b_gemm
"""

from __future__ import annotations

import abc

import jax
import numpy as np

from lora_runtime.lora.batch_info import LoRABatchInfo, build_batch_info


class BaseLoRABackend(abc.ABC):
    """Applies per-token adapters; one instance per engine, shared by every step."""

    name: str

    def __init__(self, mesh: jax.sharding.Mesh | None = None):
        self.mesh = mesh

    def prepare_lora_batch(
        self,
        token_slots: np.ndarray,  # i32[T], -1 = no adapter
        slot_scalings: np.ndarray,  # f32[S]
        slot_ranks: np.ndarray,  # i32[S]
    ) -> LoRABatchInfo:
        """Host-side metadata for one step (sorted order and segments for SGMV)."""
        return build_batch_info(token_slots, slot_scalings, slot_ranks)

    @abc.abstractmethod
    def run_lora_a_gemm(
        self,
        x: jax.Array,  # [T, in]
        a: jax.Array,  # [S, n*R, in] ([L, S, n*R, in] with layer)
        info: LoRABatchInfo,
        *,
        prefill: bool,
        parallel: str,
        layer: int | None = None,
    ) -> jax.Array:  # f32[T, n*R], scaled by slot_scalings; zero for slot -1
        """Shrink: v[t] = (x[t] @ A[slot[t]]ᵀ) * scaling[slot[t]]."""

    @abc.abstractmethod
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
        """Expand: y_i[t] = base_i[t] + v[t, i*R:(i+1)*R] @ B_i[slot[t]]."""

    def run_lora(
        self,
        x: jax.Array,  # [T, in]
        a: jax.Array,  # [S, n*R, in] ([L, S, n*R, in] with layer)
        b: tuple[jax.Array, ...],  # n × [S, R, out_i] ([L, S, R, out_i] with layer)
        base_outputs: tuple[jax.Array, ...],  # n × [T, out_i]
        info: LoRABatchInfo,
        *,
        prefill: bool,
        parallel: str,
        layer: int | None = None,
    ) -> tuple[jax.Array, ...]:
        """Shrink then expand; backends with a fused kernel override this."""
        v = self.run_lora_a_gemm(x, a, info, prefill=prefill, parallel=parallel, layer=layer)
        return self.run_lora_b_gemm(v, b, base_outputs, info, prefill=prefill, parallel=parallel, layer=layer)

    def run_qkv_lora(self, x, a, b, base_outputs, info, *, prefill: bool, layer: int | None = None):
        """Fused q/k/v: one shrink over 3 stacked slices, three expands (GQA sizes)."""
        if len(b) != 3 or len(base_outputs) != 3:
            raise ValueError(f"qkv needs 3 slices, got {len(b)} B and {len(base_outputs)} outputs")
        return self.run_lora(x, a, b, base_outputs, info, prefill=prefill, parallel="column", layer=layer)

    def run_gate_up_lora(self, x, a, b, base_outputs, info, *, prefill: bool, layer: int | None = None):
        """Fused gate/up: one shrink over 2 stacked slices, two expands."""
        if len(b) != 2 or len(base_outputs) != 2:
            raise ValueError(f"gate_up needs 2 slices, got {len(b)} B and {len(base_outputs)} outputs")
        return self.run_lora(x, a, b, base_outputs, info, prefill=prefill, parallel="column", layer=layer)


def select_layer(arr: jax.Array, layer: int | None) -> jax.Array:
    """One layer of a stacked pool array, or the array itself when no layer is given."""
    return arr if layer is None else arr[layer]
