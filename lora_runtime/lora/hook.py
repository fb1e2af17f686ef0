"""The LoRAHook the model calls, reading adapters from the memory pool through a backend."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lora_runtime.lora.adapter import EMBED, HEAD
from lora_runtime.lora.backend.base import BaseLoRABackend
from lora_runtime.lora.batch_info import SLOT_BIAS, SLOT_DORA, SLOT_EMBED, SLOT_HEAD, LoRABatchInfo
from lora_runtime.lora.memory_pool import LoRAMemoryPool
from lora_runtime.model.lora_hook import GROUP_SLICES


class PoolLoRAHook:
    """Adds each token's adapter to a projection group, the embedding and the head; build it
    inside the jitted step. Each rank class of the pool runs the backend's op on its own
    tokens at its own width (the others see slot -1), adding into the same outputs. Work an
    adapter of the step does not need (DoRA scales, lora_bias shifts, embedding or head
    deltas) is skipped by a branch on the step's slot flags. A token whose adapter saved a
    trained copy of the embedding or the head (modules_to_save) reads that copy instead of
    the base module's, each saved-module slot behind a branch on whether any token of the
    step uses it."""

    def __init__(self, backend: BaseLoRABackend, pool: LoRAMemoryPool, info: LoRABatchInfo, *, prefill: bool):
        self.backend = backend
        self.pool = pool
        self.info = info
        self.prefill = prefill
        # One view per rank class, made once per step and shared by every layer.
        self.class_infos = tuple(info.for_class(rc.first_slot, rc.num_slots) for rc in pool.classes)

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
        kw = dict(prefill=self.prefill, layer=layer)
        ys = tuple(base_outputs)
        for c, info in enumerate(self.class_infos):
            # The whole stacked pool and the layer: the kernels read the layer in place.
            a, b = self.pool.stacked_group(group, c)
            if group == "qkv":
                ys = self.backend.run_qkv_lora(x, a, b, ys, info, **kw)
            elif group == "gate_up":
                ys = self.backend.run_gate_up_lora(x, a, b, ys, info, **kw)
            else:
                ys = self.backend.run_lora(x, a, b, ys, info, parallel="row", **kw)
            ys = tuple(ys)
        return self._terms(group, layer, ys, self.class_infos, self.info.token_slots)

    def embed(self, tokens: jax.Array, x: jax.Array) -> jax.Array:  # i32[T], [T, H] -> [T, H]
        """The embeddings with each token's embed_tokens adapter added, or its saved copy's
        row instead of the base one."""
        if self.pool.has_saved(EMBED):
            table = self.pool.saved_table(EMBED)  # [S', V, H]
            saved = self.info.saved_slots(EMBED, self.info.token_slots)

            def replace(x):
                row = table[jnp.maximum(saved, 0), jnp.clip(tokens, 0, table.shape[1] - 1)]
                return jnp.where((saved >= 0)[:, None], row.astype(x.dtype), x)

            x = jax.lax.cond(jnp.any(saved >= 0), replace, lambda x: x, x)
        if not self.pool.holds(EMBED):
            return x

        def add(x):
            for c, info in enumerate(self.class_infos):
                a, b = self.pool.stacked_group(EMBED, c)  # A [1, S_c, R_c, V], B ([1, S_c, R_c, H],)
                slots = info.token_slots
                safe = jnp.maximum(slots, 0)
                tok = jnp.clip(tokens, 0, a.shape[-1] - 1)
                scale = jnp.where(slots >= 0, info.slot_scalings[safe], 0.0)
                v = a[0][safe, :, tok].astype(jnp.float32) * scale[:, None]  # [T, R_c]: A[:, token], scaled
                (x,) = self.backend.run_lora_b_gemm(v, (b[0],), (x,), info, prefill=self.prefill, parallel="row",
                                                    layer=0)
            return x

        return jax.lax.cond(self.info.uses(SLOT_EMBED), add, lambda x: x, x)

    def head(self, hidden: jax.Array, logits: jax.Array,
             rows: jax.Array | None = None) -> jax.Array:  # [N, H], f32[N, V] -> f32[N, V]
        """The logits with each row's lm_head adapter added (and its DoRA scale), or computed
        by its saved copy of the head instead; row i is token rows[i] of the step (None: row i
        is token i)."""
        if not self.pool.adapts(HEAD):
            return logits
        infos, prefill, slots = self.class_infos, self.prefill, self.info.token_slots
        if rows is not None:  # a subset of the tokens: per-row slots, the decode kernel's path
            infos = tuple(dataclasses.replace(i, token_slots=i.token_slots[rows]) for i in infos)
            prefill, slots = False, slots[rows]
        if self.pool.has_saved(HEAD):
            logits = self._saved_head(hidden, logits, self.info.saved_slots(HEAD, slots))
        if not self.pool.holds(HEAD):
            return logits

        def add(logits):
            for c, info in enumerate(infos):
                a, b = self.pool.stacked_group(HEAD, c)
                # The stacked [1, S_c, ...] buffers with layer 0: kernels read them in place.
                (logits,) = self.backend.run_lora(hidden, a, (b[0],), (logits,), info, prefill=prefill,
                                                  parallel=self.pool.parallel(HEAD), layer=0)
            return logits

        logits = jax.lax.cond(_uses(self.info, SLOT_HEAD, slots), add, lambda y: y, logits)
        return self._terms(HEAD, 0, (logits,), infos, slots)[0]

    def _saved_head(self, hidden: jax.Array, logits: jax.Array, saved: jax.Array) -> jax.Array:
        """Rows whose adapter has saved-module slot k of lm_head (saved[i] == k) get their
        logits from that copy: one head matmul per slot some row uses, none for the others."""
        table = self.pool.saved_table(HEAD)  # [S', H, V]
        for k in range(table.shape[0]):
            def replace(logits, k=k):
                y = jnp.dot(hidden, table[k], preferred_element_type=jnp.float32)
                return jnp.where((saved == k)[:, None], y, logits)

            logits = jax.lax.cond(jnp.any(saved == k), replace, lambda y: y, logits)
        return logits

    def _terms(self, group: str, layer: int, ys: tuple[jax.Array, ...], infos: tuple[LoRABatchInfo, ...],
               slots: jax.Array) -> tuple[jax.Array, ...]:
        """y = scale * y + shift for tokens whose adapter has output terms (DoRA, lora_bias; the
        pool holds scale 1 and shift 0 elsewhere); `infos` are the class views of those tokens,
        `slots` their global slots."""
        if not self.pool.has_terms:
            return ys
        terms = [self.pool.output_terms(group, c) for c in range(len(infos))]
        if not terms[0][0] and not terms[0][1]:
            return ys

        def apply(ys):
            out = []
            for i, y in enumerate(ys):
                scale = shift = None
                for info, (scales, shifts) in zip(infos, terms):
                    local = info.token_slots
                    safe, on = jnp.maximum(local, 0), (local >= 0)[:, None]
                    if scales:
                        scale = jnp.where(on, scales[i][layer][safe], 1.0 if scale is None else scale)
                    if shifts:
                        shift = jnp.where(on, shifts[i][layer][safe], 0.0 if shift is None else shift)
                z = y.astype(jnp.float32)
                z = z if scale is None else z * scale
                out.append((z if shift is None else z + shift).astype(y.dtype))
            return tuple(out)

        return jax.lax.cond(_uses(self.info, SLOT_DORA | SLOT_BIAS, slots), apply, lambda ys: ys, ys)


def _uses(info: LoRABatchInfo, flag: int, token_slots: jax.Array) -> jax.Array:
    """Whether any of `token_slots` (global slots) has an adapter with `flag`."""
    return dataclasses.replace(info, token_slots=token_slots).uses(flag)
