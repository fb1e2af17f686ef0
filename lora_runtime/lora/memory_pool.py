"""Device buffers holding the adapters of every slot, laid out as backends read them.

Per projection group, stacked over layers:
    a[g]: [L, S, n*R, in]            b[g]: n × [L, S, R, out_i]
so `pool.group(layer, g)` gives the backend layout `A: [S, n*R, in]`,
`B: n × [S, R, out_i]` (lora_runtime/lora/backend/base.py), and the model's hook hands
backends `pool.stacked_group(g)` with the layer index instead, so kernels read a layer
in place (a slice feeding a custom call would be copied each step). Column groups (qkv,
gate_up) keep A replicated and shard each B_i on out; row groups (o, down) shard A on
in and keep B replicated, matching the base weights' tensor-parallel layout.

A pool created with `outer=True` also holds the groups "embed_tokens" (A [1, S, R, vocab],
B [1, S, R, hidden]; A sharded on vocab like the base embedding) and "lm_head" (A
[1, S, R, hidden], B [1, S, R, vocab]; column-parallel on vocab like the base head, or
row-parallel when the mesh does not divide the vocabulary). With `dora=True` it holds
DoRA's per-output scale of every slot, `scale[g]`: n × [L, S, out_i] f32 (1 for a plain
adapter), sharded like the outputs, and for groups whose base layer has a bias,
`shift[g]` = (1 - scale) * bias; the step computes y = scale * (base + delta) + shift.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from lora_runtime.lora.adapter import EMBED, HEAD, OUTER_MODULES, group_shapes, outer_shapes
from lora_runtime.model.lora_hook import GROUPS
from lora_runtime.model.sharding import zeros_on

TENSOR_AXIS = "tensor"
COLUMN_GROUPS = ("qkv", "gate_up")
# Which base layers of a group have a bias, by ModelConfig field.
_BIAS_FIELD = {"qkv": "attention_bias", "o": "attention_out_bias", "gate_up": "mlp_bias", "down": "mlp_bias"}


@dataclasses.dataclass(frozen=True)
class PoolLayout:
    """The static shape of a pool: its groups, their parallelism and what each slot holds."""

    groups: tuple[str, ...]  # GROUPS, then OUTER_MODULES when the pool holds them
    parallel: tuple[str, ...]  # per group: "column" or "row"
    vocab_sharded: bool  # the embedding's A is sharded on vocab (the mesh divides it)
    dora: bool
    biased: tuple[bool, ...]  # per group: a DoRA shift is held (its base layer has a bias)

    @classmethod
    def of(cls, model_config, tp: int, *, outer: bool, dora: bool) -> PoolLayout:
        groups = GROUPS + (OUTER_MODULES if outer else ())
        vocab_ok = model_config.vocab_size % tp == 0
        parallel = tuple("column" if g in COLUMN_GROUPS or (g == HEAD and vocab_ok) else "row" for g in groups)
        biased = tuple(dora and bool(getattr(model_config, _BIAS_FIELD[g], False)) if g in _BIAS_FIELD else False
                       for g in groups)
        return cls(groups=groups, parallel=parallel, vocab_sharded=vocab_ok, dora=dora, biased=biased)

    def specs(self, group: str) -> tuple[P, P, P]:
        """PartitionSpecs of a group's A [L, S, n*R, in], each B_i [L, S, R, out_i] and each
        scale/shift [L, S, out_i]."""
        if group == EMBED:
            return (P(None, None, None, TENSOR_AXIS if self.vocab_sharded else None), P(None, None, None, None),
                    P(None, None, None))
        column = self.parallel[self.groups.index(group)] == "column"
        if column:
            return P(None, None, None, None), P(None, None, None, TENSOR_AXIS), P(None, None, TENSOR_AXIS)
        return P(None, None, None, TENSOR_AXIS), P(None, None, None, None), P(None, None, None)

    def has_scale(self, group: str) -> bool:
        return self.dora and group != EMBED


def group_dims(model_config, group: str) -> tuple[int, int, tuple[int, ...]]:
    """(layers, in, (out_i per slice)) of a pool group."""
    if group in OUTER_MODULES:
        fan_in, fan_out = outer_shapes(model_config)[group]
        return 1, fan_in, (fan_out,)
    fan_in, outs = group_shapes(model_config)[group]
    return model_config.num_layers, fan_in, outs


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=("a", "b", "scale", "shift"),
    meta_fields=("mesh", "num_slots", "max_lora_rank", "layout"),
)
@dataclasses.dataclass(frozen=True)
class LoRAMemoryPool:
    """Every slot's adapter weights for all layers and groups; a pytree of device arrays."""

    a: tuple[jax.Array, ...]  # per group in layout.groups: [L, S, n*R, in]
    b: tuple[tuple[jax.Array, ...], ...]  # per group: n × [L, S, R, out_i]
    mesh: jax.sharding.Mesh
    num_slots: int
    max_lora_rank: int
    layout: PoolLayout
    scale: tuple[tuple[jax.Array, ...], ...] = ()  # per group: n × f32[L, S, out_i] (DoRA); () without
    shift: tuple[tuple[jax.Array, ...], ...] = ()  # per group: n × f32[L, S, out_i] where biased, else ()

    @classmethod
    def create(cls, model_config, mesh: jax.sharding.Mesh, *, num_slots: int, max_lora_rank: int,
               dtype, outer: bool = False, dora: bool = False) -> LoRAMemoryPool:
        """An empty pool of `num_slots` slots of rank `max_lora_rank`, sharded on `mesh`;
        `outer`: room for embed_tokens and lm_head adapters, `dora`: for DoRA scales."""
        if num_slots <= 0:
            raise ValueError(f"{num_slots=} must be positive")
        if max_lora_rank <= 0:
            raise ValueError(f"{max_lora_rank=} must be positive")
        tp = mesh.shape.get(TENSOR_AXIS, 1)
        layout = PoolLayout.of(model_config, tp, outer=outer, dora=dora)
        a, b, scale, shift = [], [], [], []
        for g, parallel, biased in zip(layout.groups, layout.parallel, layout.biased):
            depth, fan_in, outs = group_dims(model_config, g)
            # The dimensions the mesh splits (the embedding's vocab only where it divides it).
            if g == EMBED:
                sharded = (fan_in,) if layout.vocab_sharded else ()
            else:
                sharded = outs if parallel == "column" else (fan_in,)
            for dim in sharded:
                if dim % tp:
                    raise ValueError(f"group {g!r} dimension {dim} is not divisible by tensor parallel size {tp}")
            a_spec, b_spec, s_spec = layout.specs(g)
            a.append(zeros_on((depth, num_slots, len(outs) * max_lora_rank, fan_in), dtype,
                              NamedSharding(mesh, a_spec)))
            b.append(tuple(zeros_on((depth, num_slots, max_lora_rank, o), dtype, NamedSharding(mesh, b_spec))
                           for o in outs))
            if dora:
                on = layout.has_scale(g)
                scale.append(tuple(_ones_on((depth, num_slots, o), NamedSharding(mesh, s_spec)) for o in outs)
                             if on else ())
                shift.append(tuple(zeros_on((depth, num_slots, o), jnp.float32, NamedSharding(mesh, s_spec))
                                   for o in outs) if on and biased else ())
        return cls(a=tuple(a), b=tuple(b), mesh=mesh, num_slots=num_slots, max_lora_rank=max_lora_rank,
                   layout=layout, scale=tuple(scale), shift=tuple(shift))

    @property
    def groups(self) -> tuple[str, ...]:
        return self.layout.groups

    def holds(self, group: str) -> bool:
        return group in self.groups

    @property
    def dora(self) -> bool:
        return self.layout.dora

    def parallel(self, group: str) -> str:
        return self.layout.parallel[self.groups.index(group)]

    def group(self, layer, group: str) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """(A [S, n*R, in], B n × [S, R, out_i]) of one layer and group; `layer` may be traced."""
        g = self.groups.index(group)
        return self.a[g][layer], tuple(b[layer] for b in self.b[g])

    def stacked_group(self, group: str) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """(A [L, S, n*R, in], B n × [L, S, R, out_i]) of one group, all layers."""
        g = self.groups.index(group)
        return self.a[g], self.b[g]

    def dora_terms(self, group: str) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """(scale, shift) of a group, each n × f32[L, S, out_i] (shift () without a bias)."""
        g = self.groups.index(group)
        return self.scale[g], self.shift[g]

    @property
    def num_layers(self) -> int:
        return self.a[0].shape[0]

    @property
    def dtype(self):
        return self.a[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))

    @property
    def slot_nbytes(self) -> int:
        """Bytes one slot write moves (an adapter's padded pool layout)."""
        return self.nbytes // self.num_slots

    def _specs(self, group: str) -> tuple[P, P, P]:
        return self.layout.specs(group)

    def slot_shardings(self) -> tuple[tuple[NamedSharding, tuple[NamedSharding, ...]], ...]:
        """Shardings of one slot's weights ([L, n*R, in] and [L, R, out_i]) per group."""
        out = []
        for g, bs in zip(self.groups, self.b):
            a_spec, b_spec, _ = self._specs(g)
            out.append((NamedSharding(self.mesh, _without_slot_axis(a_spec)),
                        tuple(NamedSharding(self.mesh, _without_slot_axis(b_spec)) for _ in bs)))
        return tuple(out)

    def shardings(self) -> tuple[tuple[NamedSharding, tuple[NamedSharding, ...]], ...]:
        """Shardings of each group's A and B_i buffers."""
        out = []
        for g, bs in zip(self.groups, self.b):
            a_spec, b_spec, _ = self._specs(g)
            out.append((NamedSharding(self.mesh, a_spec), tuple(NamedSharding(self.mesh, b_spec) for _ in bs)))
        return tuple(out)

    def term_shardings(self, terms) -> tuple[tuple[NamedSharding, ...], ...]:
        """Shardings of the scale (or shift) buffers `terms`, per group."""
        return tuple(tuple(NamedSharding(self.mesh, self._specs(g)[2]) for _ in ts) for g, ts in zip(self.groups, terms))


def _without_slot_axis(spec: P) -> P:
    return P(spec[0], *spec[2:])


def _ones_on(shape, sharding) -> jax.Array:
    return jax.jit(lambda: jnp.ones(shape, jnp.float32), out_shardings=sharding)()


@dataclasses.dataclass(frozen=True)
class DoraTerms:
    """One adapter's DoRA scale and shift per group (n × f32[L, out_i]; shift only where
    the pool holds one); lora_runtime/lora/dora.py computes them."""

    scale: dict[str, tuple[np.ndarray, ...]]
    shift: dict[str, tuple[np.ndarray, ...]]


def plain_terms(pool: LoRAMemoryPool) -> DoraTerms | None:
    """The DoRA terms of an adapter without DoRA (scale 1, shift 0), for a pool that holds them."""
    if not pool.dora:
        return None
    scale = {g: tuple(np.ones((x.shape[0], x.shape[2]), np.float32) for x in ts) for g, ts in zip(pool.groups, pool.scale)}
    shift = {g: tuple(np.zeros((x.shape[0], x.shape[2]), np.float32) for x in ts) for g, ts in zip(pool.groups, pool.shift)}
    return DoraTerms(scale=scale, shift=shift)


def put_slot_weights(pool: LoRAMemoryPool,
                     weights: dict[str, tuple[np.ndarray, tuple[np.ndarray, ...]]], terms: DoraTerms | None = None):
    """Moves one adapter's pool layout (LoRAAdapter.pool_weights, and its DoRA terms for a
    pool that holds them) to the devices, sharded like the pool."""
    out = []
    for g, (a_sh, b_sh) in zip(pool.groups, pool.slot_shardings()):
        a, bs = weights[g]
        out.append((jax.device_put(np.asarray(a, pool.dtype), a_sh),
                    tuple(jax.device_put(np.asarray(b, pool.dtype), s) for b, s in zip(bs, b_sh))))
    if not pool.dora:
        return tuple(out), (), ()
    terms = terms or plain_terms(pool)

    def put(values: dict, bufs) -> tuple:
        out = []
        for g, held in zip(pool.groups, bufs):
            xs = values.get(g, ())
            if len(xs) != len(held) or any(x.shape != (h.shape[0], h.shape[2]) for x, h in zip(xs, held)):
                raise ValueError(f"DoRA terms for group {g!r} have shapes {[x.shape for x in xs]}; the pool "
                                 f"wants {[(h.shape[0], h.shape[2]) for h in held]}")
            sharding = NamedSharding(pool.mesh, _without_slot_axis(pool._specs(g)[2]))
            out.append(tuple(jax.device_put(np.asarray(x, np.float32), sharding) for x in xs))
        return tuple(out)

    return tuple(out), put(terms.scale, pool.scale), put(terms.shift, pool.shift)


def _set_slot(pool: LoRAMemoryPool, slot: jax.Array, weights, scale=(), shift=()) -> LoRAMemoryPool:
    """`weights[g] = (A, B_tuple)` of one slot (and its DoRA scale/shift), or scalars to fill it with."""
    a = tuple(buf.at[:, slot].set(w[0]) for buf, w in zip(pool.a, weights))
    b = tuple(tuple(buf.at[:, slot].set(x) for buf, x in zip(bufs, w[1])) for bufs, w in zip(pool.b, weights))
    sc = tuple(tuple(buf.at[:, slot].set(x) for buf, x in zip(bufs, xs)) for bufs, xs in zip(pool.scale, scale))
    sh = tuple(tuple(buf.at[:, slot].set(x) for buf, x in zip(bufs, xs)) for bufs, xs in zip(pool.shift, shift))
    return dataclasses.replace(pool, a=a, b=b, scale=sc if pool.dora else (), shift=sh if pool.dora else ())


def _clear_slot(pool: LoRAMemoryPool, slot: jax.Array) -> LoRAMemoryPool:
    zeros = tuple((jnp.zeros((), pool.dtype), tuple(jnp.zeros((), pool.dtype) for _ in bs)) for bs in pool.b)
    ones = tuple(tuple(jnp.ones((), jnp.float32) for _ in ts) for ts in pool.scale)
    nothing = tuple(tuple(jnp.zeros((), jnp.float32) for _ in ts) for ts in pool.shift)
    return _set_slot(pool, slot, zeros, ones, nothing)


@functools.cache
def updater(kind: str, out_shardings: LoRAMemoryPool):
    """The jitted slot update ("write" or "clear") for pools sharded as `out_shardings`.

    Explicit output shardings keep every buffer's sharding exactly as created (XLA
    would otherwise normalize trivial ones), so a step jitted on the pool never
    recompiles after a write. One compile per pool layout, whatever the slot.
    """
    fn = {"write": _set_slot, "clear": _clear_slot}[kind]
    return jax.jit(fn, donate_argnums=0, out_shardings=out_shardings)


def _sharding_tree(pool: LoRAMemoryPool) -> LoRAMemoryPool:
    sh = pool.shardings()
    return dataclasses.replace(pool, a=tuple(x[0] for x in sh), b=tuple(x[1] for x in sh),
                               scale=pool.term_shardings(pool.scale), shift=pool.term_shardings(pool.shift))


def write_slot(pool: LoRAMemoryPool, slot: int,
               weights: dict[str, tuple[np.ndarray, tuple[np.ndarray, ...]]],
               terms: DoraTerms | None = None) -> LoRAMemoryPool:
    """A pool with `slot` holding `weights` (LoRAAdapter.pool_weights) and, for a pool with
    DoRA room, the adapter's DoRA `terms` (None: a plain adapter); `pool` is donated.

    The slot index is traced, so every slot shares one compiled update, and the
    donated buffers are updated in place: the write moves one adapter's bytes.
    """
    _check_slot(pool, slot)
    missing = [g for g in pool.groups if g not in weights]
    if missing:
        raise ValueError(f"slot weights lack groups {missing} the pool holds (pool_weights(outer=...))")
    for g, (a, bs) in weights.items():
        if g not in pool.groups:
            raise ValueError(f"slot weights hold group {g!r}, which the pool does not")
        want_a, want_b = pool.a[pool.groups.index(g)], pool.b[pool.groups.index(g)]
        if a.shape != (want_a.shape[0], *want_a.shape[2:]) or any(
                x.shape != (y.shape[0], *y.shape[2:]) for x, y in zip(bs, want_b)) or len(bs) != len(want_b):
            raise ValueError(f"slot weights for group {g!r} have shapes {a.shape}, {[x.shape for x in bs]}; "
                             f"pool wants {(want_a.shape[0], *want_a.shape[2:])}, "
                             f"{[(y.shape[0], *y.shape[2:]) for y in want_b]}")
    return updater("write", _sharding_tree(pool))(pool, jnp.int32(slot), *put_slot_weights(pool, weights, terms))


def clear_slot(pool: LoRAMemoryPool, slot: int) -> LoRAMemoryPool:
    """A pool with `slot` all zero; `pool` is donated."""
    _check_slot(pool, slot)
    return updater("clear", _sharding_tree(pool))(pool, jnp.int32(slot))


def _check_slot(pool: LoRAMemoryPool, slot: int) -> None:
    if not 0 <= slot < pool.num_slots:
        raise ValueError(f"{slot=} outside [0, {pool.num_slots})")
