"""Device buffers holding the adapters of every slot, laid out as backends read them.

Per projection group, stacked over layers:
    a[g]: [L, S, n*R, in]            b[g]: n × [L, S, R, out_i]
so `pool.group(layer, g)` gives the backend layout `A: [S, n*R, in]`,
`B: n × [S, R, out_i]` (lora_runtime/lora/backend/base.py), and the model's hook hands
backends `pool.stacked_group(g)` with the layer index instead, so kernels read a layer
in place (a slice feeding a custom call would be copied each step). Column groups (qkv,
gate_up) keep A replicated and shard each B_i on out; row groups (o, down) shard A on
in and keep B replicated, matching the base weights' tensor-parallel layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from lora_runtime.lora.adapter import group_shapes
from lora_runtime.model.lora_hook import GROUPS
from lora_runtime.model.sharding import zeros_on

TENSOR_AXIS = "tensor"
COLUMN_GROUPS = ("qkv", "gate_up")


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=("a", "b"), meta_fields=("mesh", "num_slots", "max_lora_rank")
)
@dataclasses.dataclass(frozen=True)
class LoRAMemoryPool:
    """Every slot's adapter weights for all layers and groups; a pytree of device arrays."""

    a: tuple[jax.Array, ...]  # per group in GROUPS: [L, S, n*R, in]
    b: tuple[tuple[jax.Array, ...], ...]  # per group: n × [L, S, R, out_i]
    mesh: jax.sharding.Mesh
    num_slots: int
    max_lora_rank: int

    @classmethod
    def create(cls, model_config, mesh: jax.sharding.Mesh, *, num_slots: int, max_lora_rank: int,
               dtype) -> LoRAMemoryPool:
        """An all-zero pool of `num_slots` slots of rank `max_lora_rank`, sharded on `mesh`."""
        if num_slots <= 0:
            raise ValueError(f"{num_slots=} must be positive")
        if max_lora_rank <= 0:
            raise ValueError(f"{max_lora_rank=} must be positive")
        tp = mesh.shape.get(TENSOR_AXIS, 1)
        L = model_config.num_layers
        a, b = [], []
        for g, (fan_in, outs) in group_shapes(model_config).items():
            sharded = outs if g in COLUMN_GROUPS else (fan_in,)
            for dim in sharded:
                if dim % tp:
                    raise ValueError(f"group {g!r} dimension {dim} is not divisible by tensor parallel size {tp}")
            a_spec, b_spec = pool_specs(g)
            a.append(zeros_on((L, num_slots, len(outs) * max_lora_rank, fan_in), dtype, NamedSharding(mesh, a_spec)))
            b.append(tuple(zeros_on((L, num_slots, max_lora_rank, o), dtype, NamedSharding(mesh, b_spec)) for o in outs))
        return cls(a=tuple(a), b=tuple(b), mesh=mesh, num_slots=num_slots, max_lora_rank=max_lora_rank)

    def group(self, layer, group: str) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """(A [S, n*R, in], B n × [S, R, out_i]) of one layer and group; `layer` may be traced."""
        g = GROUPS.index(group)
        return self.a[g][layer], tuple(b[layer] for b in self.b[g])

    def stacked_group(self, group: str) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """(A [L, S, n*R, in], B n × [L, S, R, out_i]) of one group, all layers."""
        g = GROUPS.index(group)
        return self.a[g], self.b[g]

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

    def slot_shardings(self) -> tuple[tuple[NamedSharding, tuple[NamedSharding, ...]], ...]:
        """Shardings of one slot's weights ([L, n*R, in] and [L, R, out_i]) per group."""
        out = []
        for g, bs in zip(GROUPS, self.b):
            a_spec, b_spec = pool_specs(g)
            out.append((NamedSharding(self.mesh, _without_slot_axis(a_spec)),
                        tuple(NamedSharding(self.mesh, _without_slot_axis(b_spec)) for _ in bs)))
        return tuple(out)

    def shardings(self) -> tuple[tuple[NamedSharding, tuple[NamedSharding, ...]], ...]:
        """Shardings of each group's A and B_i buffers."""
        out = []
        for g, bs in zip(GROUPS, self.b):
            a_spec, b_spec = pool_specs(g)
            out.append((NamedSharding(self.mesh, a_spec), tuple(NamedSharding(self.mesh, b_spec) for _ in bs)))
        return tuple(out)


def pool_specs(group: str) -> tuple[P, P]:
    """PartitionSpecs of a group's A [L, S, n*R, in] and each B_i [L, S, R, out_i]."""
    if group in COLUMN_GROUPS:
        return P(None, None, None, None), P(None, None, None, TENSOR_AXIS)
    return P(None, None, None, TENSOR_AXIS), P(None, None, None, None)


def _without_slot_axis(spec: P) -> P:
    return P(spec[0], *spec[2:])


def put_slot_weights(pool: LoRAMemoryPool,
                     weights: dict[str, tuple[np.ndarray, tuple[np.ndarray, ...]]]):
    """Moves one adapter's pool layout (LoRAAdapter.pool_weights) to the devices, sharded like the pool."""
    out = []
    for g, (a_sh, b_sh) in zip(GROUPS, pool.slot_shardings()):
        a, bs = weights[g]
        out.append((jax.device_put(np.asarray(a, pool.dtype), a_sh),
                    tuple(jax.device_put(np.asarray(b, pool.dtype), s) for b, s in zip(bs, b_sh))))
    return tuple(out)


def _set_slot(pool: LoRAMemoryPool, slot: jax.Array, weights) -> LoRAMemoryPool:
    """`weights[g] = (A, B_tuple)` of one slot, or scalars to fill it with."""
    a = tuple(buf.at[:, slot].set(w[0]) for buf, w in zip(pool.a, weights))
    b = tuple(tuple(buf.at[:, slot].set(x) for buf, x in zip(bufs, w[1])) for bufs, w in zip(pool.b, weights))
    return dataclasses.replace(pool, a=a, b=b)


def _clear_slot(pool: LoRAMemoryPool, slot: jax.Array) -> LoRAMemoryPool:
    zeros = tuple((jnp.zeros((), pool.dtype), tuple(jnp.zeros((), pool.dtype) for _ in bs)) for bs in pool.b)
    return _set_slot(pool, slot, zeros)


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
    return dataclasses.replace(pool, a=tuple(x[0] for x in sh), b=tuple(x[1] for x in sh))


def write_slot(pool: LoRAMemoryPool, slot: int,
               weights: dict[str, tuple[np.ndarray, tuple[np.ndarray, ...]]]) -> LoRAMemoryPool:
    """A pool with `slot` holding `weights` (LoRAAdapter.pool_weights); `pool` is donated.

    The slot index is traced, so every slot shares one compiled update, and the
    donated buffers are updated in place: the write moves one adapter's bytes.
    """
    _check_slot(pool, slot)
    for g, (a, bs) in weights.items():
        want_a, want_b = pool.a[GROUPS.index(g)], pool.b[GROUPS.index(g)]
        if a.shape != (want_a.shape[0], *want_a.shape[2:]) or any(
                x.shape != (y.shape[0], *y.shape[2:]) for x, y in zip(bs, want_b)) or len(bs) != len(want_b):
            raise ValueError(f"slot weights for group {g!r} have shapes {a.shape}, {[x.shape for x in bs]}; "
                             f"pool wants {(want_a.shape[0], *want_a.shape[2:])}, "
                             f"{[(y.shape[0], *y.shape[2:]) for y in want_b]}")
    return updater("write", _sharding_tree(pool))(pool, jnp.int32(slot), put_slot_weights(pool, weights))


def clear_slot(pool: LoRAMemoryPool, slot: int) -> LoRAMemoryPool:
    """A pool with `slot` all zero; `pool` is donated."""
    _check_slot(pool, slot)
    return updater("clear", _sharding_tree(pool))(pool, jnp.int32(slot))


def _check_slot(pool: LoRAMemoryPool, slot: int) -> None:
    if not 0 <= slot < pool.num_slots:
        raise ValueError(f"{slot=} outside [0, {pool.num_slots})")
