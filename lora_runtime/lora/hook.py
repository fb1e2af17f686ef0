"""The LoRAHook the model calls, reading adapters from the memory pool through a backend."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lora_runtime.lora.adapter import EMBED, HEAD
from lora_runtime.lora.backend.base import BaseLoRABackend
from lora_runtime.lora.batch_info import SLOT_DORA, SLOT_EMBED, SLOT_HEAD, LoRABatchInfo
from lora_runtime.lora.memory_pool import LoRAMemoryPool
from lora_runtime.model.lora_hook import GROUP_SLICES


class PoolLoRAHook:
    """Adds each token's adapter to a projection group, the embedding and the head; build it
    inside the jitted step. Work an adapter of the step does not need (DoRA scales, embedding
    or head deltas) is skipped by a branch on the step's slot flags."""

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
            ys = self.backend.run_qkv_lora(x, a, b, base_outputs, self.info, **kw)
        elif group == "gate_up":
            ys = self.backend.run_gate_up_lora(x, a, b, base_outputs, self.info, **kw)
        else:
            ys = self.backend.run_lora(x, a, b, base_outputs, self.info, parallel="row", **kw)
        return self._dora(group, layer, tuple(ys), self.info.token_slots)

    def embed(self, tokens: jax.Array, x: jax.Array) -> jax.Array:  # i32[T], [T, H] -> [T, H]
        """The embeddings with each token's embed_tokens adapter added."""
        if not self.pool.holds(EMBED):
            return x
        info = self.info

        def add(x):
            a, b = self.pool.stacked_group(EMBED)  # A [1, S, R, V], B ([1, S, R, H],)
            slots = info.token_slots
            safe = jnp.maximum(slots, 0)
            tok = jnp.clip(tokens, 0, a.shape[-1] - 1)
            scale = jnp.where(slots >= 0, info.slot_scalings[safe], 0.0)
            v = a[0][safe, :, tok].astype(jnp.float32) * scale[:, None]  # [T, R]: A[:, token], scaled
            (y,) = self.backend.run_lora_b_gemm(v, (b[0],), (x,), info, prefill=self.prefill, parallel="row", layer=0)
            return y

        return jax.lax.cond(info.uses(SLOT_EMBED), add, lambda x: x, x)

    def head(self, hidden: jax.Array, logits: jax.Array,
             rows: jax.Array | None = None) -> jax.Array:  # [N, H], f32[N, V] -> f32[N, V]
        """The logits with each row's lm_head adapter added (and its DoRA scale); row i is
        token rows[i] of the step (None: row i is token i)."""
        if not self.pool.holds(HEAD):
            return logits
        info = self.info
        prefill = self.prefill
        if rows is not None:  # a subset of the tokens: per-row slots, the decode kernel's path
            info = dataclasses.replace(info, token_slots=info.token_slots[rows])
            prefill = False

        def add(logits):
            a, b = self.pool.stacked_group(HEAD)
            # The stacked [1, S, ...] buffers with layer 0: kernels read them in place.
            (y,) = self.backend.run_lora(hidden, a, (b[0],), (logits,), info, prefill=prefill,
                                         parallel=self.pool.parallel(HEAD), layer=0)
            return y

        logits = jax.lax.cond(info.uses(SLOT_HEAD), add, lambda y: y, logits)
        return self._dora(HEAD, 0, (logits,), info.token_slots)[0]

    def _dora(self, group: str, layer: int, ys: tuple[jax.Array, ...], slots: jax.Array) -> tuple[jax.Array, ...]:
        """y = scale * y + shift for tokens whose adapter is DoRA (pool.scale is 1 elsewhere)."""
        if not self.pool.dora:
            return ys
        scales, shifts = self.pool.dora_terms(group)
        if not scales:
            return ys
        info = dataclasses.replace(self.info, token_slots=slots)

        def apply(ys):
            safe = jnp.maximum(slots, 0)
            on = (slots >= 0)[:, None]
            out = []
            for i, y in enumerate(ys):
                z = y.astype(jnp.float32) * jnp.where(on, scales[i][layer][safe], 1.0)
                if shifts:
                    z = z + jnp.where(on, shifts[i][layer][safe], 0.0)
                out.append(z.astype(y.dtype))
            return tuple(out)

        return jax.lax.cond(info.uses(SLOT_DORA), apply, lambda ys: ys, ys)
