"""The LoRAHook the model calls, reading adapters from the memory pool through a backend."""

from __future__ import annotations

import jax

from lora_runtime.lora.backend.base import BaseLoRABackend
from lora_runtime.lora.batch_info import LoRABatchInfo
from lora_runtime.lora.memory_pool import LoRAMemoryPool
from lora_runtime.model.lora_hook import GROUP_SLICES


class PoolLoRAHook:
    """Adds each token's adapter to a projection group; build it inside the jitted step."""

    def __init__(self, backend: BaseLoRABackend, pool: LoRAMemoryPool, info: LoRABatchInfo, *, prefill: bool):
        self.backend = backend
        self.pool = pool
        self.info = info
        self.prefill = prefill

    def __call__(
        self,
        group: str,
        layer: int,
        x: jax.Array,  # [T, in]
        base_outputs: tuple[jax.Array, ...],  # each [T, out_i]
    ) -> tuple[jax.Array, ...]:  # each [T, out_i]
        if group not in GROUP_SLICES:
            raise ValueError(f"{group=} is not one of {list(GROUP_SLICES)}")
        if len(base_outputs) != len(GROUP_SLICES[group]):
            raise ValueError(f"group {group!r} has {len(GROUP_SLICES[group])} slices, got {len(base_outputs)} outputs")
        # The whole stacked pool and the layer: the kernels read the layer in place.
        a, b = self.pool.stacked_group(group)
        kw = dict(prefill=self.prefill, layer=layer)
        if group == "qkv":
            return self.backend.run_qkv_lora(x, a, b, base_outputs, self.info, **kw)
        if group == "gate_up":
            return self.backend.run_gate_up_lora(x, a, b, base_outputs, self.info, **kw)
        return self.backend.run_lora(x, a, b, base_outputs, self.info, parallel="row", **kw)
