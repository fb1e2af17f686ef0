"""An adapter's per-output terms at load time: DoRA's scale from its magnitude and the base
weights, and the shift of DoRA on a biased layer or of PEFT's lora_bias.

PEFT applies a DoRA module as y = g * (W x + s * B A x) + (1 - g) * bias with
g = magnitude / ||W + s * B A||_row (the row norms of the merged weight, [out]). The
norms depend only on the adapter and the base model, so they are computed once, when an
adapter is padded for its slot, on the device that holds W (fetch thread; the base weights
are read-only), without forming the [in, out] merged matrix:

    ||W_o + s (BA)_o||² = ||W_o||² + 2 s B_o · (A W)_o + s² B_o (A Aᵀ) B_oᵀ

Each module shape compiles once (A and B arrive padded to the slot rank).

With lora_bias, lora_B is a Linear with a bias c, so the module adds s * (B A x + c): the
shift s * c of each output, fixed per adapter (PEFT allows it without DoRA only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from lora_runtime.lora.adapter import EMBED, NO_LAYER, LoRAAdapter, module_shapes, outer_shapes, served_rows
from lora_runtime.lora.base_weights import BaseWeights
from lora_runtime.lora.memory_pool import LoRAMemoryPool, OutputTerms, plain_terms
from lora_runtime.model.lora_hook import GROUP_SLICES
from lora_runtime.model.sharding import host_value


@functools.cache
def _scale_fn(out_in: bool, mesh):
    """The jitted _scale, its output whole on every device of `mesh` (so any host reads it)."""
    return jax.jit(functools.partial(_scale, out_in=out_in), out_shardings=NamedSharding(mesh, PartitionSpec()))


def _scale(w, a, b, s, magnitude, *, out_in: bool):
    """g = magnitude / ||W + s B A||_row; w [in, out] (or [out, in] with out_in), a [R, in], b [out, R]."""
    w = w.astype(jnp.float32)
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    wt = w.T if out_in else w  # [in, out]
    base_sq = jnp.sum(wt * wt, axis=0)  # [out]
    aw = a @ wt  # [R, out]
    cross = jnp.sum(b * aw.T, axis=1)  # [out]
    gram = a @ a.T  # [R, R]
    lora_sq = jnp.sum((b @ gram) * b, axis=1)  # [out]
    norm = jnp.sqrt(jnp.maximum(base_sq + 2.0 * s * cross + s * s * lora_sq, 0.0))
    return magnitude.astype(jnp.float32) / norm


def module_scale(base: BaseWeights, adapter: LoRAAdapter, layer: int, module: str, rank: int) -> jax.Array | None:
    """f32[out] DoRA scale of one module of `adapter`, or None if the module has no magnitude."""
    w = adapter.weights.get((layer, module))
    if w is None or w.magnitude is None:
        return None
    r = w.a.shape[0]
    wb, magnitude = served_rows(base.config, module, w.b), served_rows(base.config, module, w.magnitude)
    a = np.zeros((rank, w.a.shape[1]), np.float32)
    b = np.zeros((wb.shape[0], rank), np.float32)
    a[:r], b[:, :r] = w.a, wb
    kernel, out_in = base.kernel(layer, module)
    return _scale_fn(out_in, kernel.sharding.mesh)(kernel, a, b, np.float32(adapter.scaling * w.ratio), magnitude)


def output_terms(pool: LoRAMemoryPool, model_config, base: BaseWeights | None,
                 adapter: LoRAAdapter) -> OutputTerms | None:
    """The adapter's per-output terms per pool group: DoRA's scale (and shift where the base
    layer has a bias), or lora_bias's shift (lora_B's bias times the module's scaling); scale 1
    and shift 0 for the modules and layers without them. None for a pool without terms."""
    terms = plain_terms(pool)
    if terms is None or not (adapter.use_dora or adapter.has_bias):
        return terms
    rank = pool.classes[pool.class_for_rank(adapter.rank)].rank  # what its weights are padded to
    for g, scales, shifts in zip(pool.groups, *pool.term_shapes()):
        if not scales and not shifts:
            continue
        modules = GROUP_SLICES.get(g, (g,))
        layers = range(pool.num_layers) if g in GROUP_SLICES else (NO_LAYER,)
        new_scale = [x.copy() for x in terms.scale[g]]
        new_shift = [x.copy() for x in terms.shift[g]]
        for i, module in enumerate(modules):
            for row, layer in enumerate(layers):
                w = adapter.weights.get((layer, module))
                if w is not None and w.bias is not None and shifts:
                    bias = served_rows(model_config, module, w.bias)
                    new_shift[i][row] = np.float32(adapter.scaling * w.ratio) * bias.astype(np.float32)
                if not scales:
                    continue
                g_vec = module_scale(base, adapter, layer, module, rank)
                if g_vec is None:
                    continue
                new_scale[i][row] = host_value(g_vec)
                if shifts:
                    bias = base.bias(layer, module)
                    if bias is not None:
                        new_shift[i][row] = (1.0 - new_scale[i][row]) * host_value(bias).astype(np.float32)
        terms.scale[g] = tuple(new_scale)
        terms.shift[g] = tuple(new_shift)
    return terms


def warm_up_scales(base: BaseWeights, model_config, rank: int, groups: tuple[str, ...]) -> None:
    """Compiles the scale of every module shape the pool's groups hold (layer 0 stands for all),
    ahead of time: running it would read whole base kernels for nothing."""
    shapes = {**module_shapes(model_config, served=True), **outer_shapes(model_config)}
    for g in groups:
        for module in GROUP_SLICES.get(g, (g,)):
            if module not in shapes or g == EMBED:
                continue
            fan_in, fan_out = shapes[module]
            layer = 0 if g in GROUP_SLICES else NO_LAYER
            kernel, out_in = base.kernel(layer, module)
            _scale_fn(out_in, kernel.sharding.mesh).lower(kernel, np.zeros((rank, fan_in), np.float32),
                                                          np.zeros((fan_out, rank), np.float32), np.float32(1.0),
                                                          np.ones(fan_out, np.float32)).compile()
            bias = base.bias(layer, module)
            if bias is not None:
                host_value(bias)  # DoRA's shift reads it (gathered, across hosts)
