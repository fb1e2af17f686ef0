"""Tensor-parallel layout of the base model: the mesh, logical axes and their mesh axes.

Column-parallel projections (q, k, v, gate, up) split their output features over the
"tensor" axis, row-parallel ones (o, down) their input features, so each layer needs
one all-reduce after o and one after down. Embedding and lm_head split the vocabulary;
norms are replicated. The KV cache splits kv heads, matching k/v projections.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lora_runtime.model.config import ModelConfig

TENSOR_AXIS = "tensor"


@functools.lru_cache(maxsize=64)
def _zeros_fn(shape: tuple[int, ...], dtype, sharding: NamedSharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def zeros_on(shape: Sequence[int], dtype, sharding: NamedSharding) -> jax.Array:
    """A zeroed array laid out by `sharding`, made on the devices (never whole on one). The
    program is kept per shape, dtype and sharding, so making the same array again (a cache
    recreated after a failed step) compiles nothing."""
    return _zeros_fn(tuple(int(d) for d in shape), jnp.dtype(dtype), sharding)()


@functools.lru_cache(maxsize=64)
def _replicate_fn(sharding: NamedSharding):
    return jax.jit(lambda x: x, out_shardings=sharding)


def host_value(x: jax.Array) -> np.ndarray:
    """The whole value of a device array on this host, whatever its sharding. On a mesh that
    spans processes it is gathered first, which every process must do alike (a collective)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(_replicate_fn(NamedSharding(x.sharding.mesh, PartitionSpec()))(x))


def make_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D ("tensor",) mesh over the first ``tensor_parallel_size`` devices."""
    available = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size < 1:
        raise ValueError(f"{tensor_parallel_size=} must be >= 1")
    if tensor_parallel_size > len(available):
        raise ValueError(f"{tensor_parallel_size=} exceeds the {len(available)} available devices")
    # Auto axes: with Explicit axes (jax.make_mesh's default) row-parallel matmuls and
    # sharding constraints fail.
    return Mesh(
        np.asarray(available[:tensor_parallel_size]),
        (TENSOR_AXIS,),
        axis_types=(jax.sharding.AxisType.Auto,),
    )


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Maps logical axis names to mesh axes (None: replicated)."""

    rules: Mapping[str, str | None]

    def spec(self, *logical_axes: str | None) -> PartitionSpec:
        """The PartitionSpec of an array whose dimensions have these logical names."""
        mesh_axes = []
        for name in logical_axes:
            if name is not None and name not in self.rules:
                raise ValueError(f"logical axis {name!r} has no sharding rule; known: {sorted(self.rules)}")
            mesh_axes.append(None if name is None else self.rules[name])
        used = [a for a in mesh_axes if a is not None]
        if len(used) != len(set(used)):
            raise ValueError(f"{logical_axes=} map to mesh axes {tuple(mesh_axes)}: one mesh axis used twice")
        return PartitionSpec(*mesh_axes)

    def sharding(self, mesh: Mesh, *logical_axes: str | None) -> NamedSharding:
        """The NamedSharding of an array whose dimensions have these logical names."""
        return NamedSharding(mesh, self.spec(*logical_axes))


DEFAULT_RULES = ShardingRules(
    {
        "vocab": TENSOR_AXIS,
        "embed": None,
        "heads": TENSOR_AXIS,  # q heads * head_dim, flat
        "kv_heads": TENSOR_AXIS,  # kv heads (* head_dim when flat)
        "mlp": TENSOR_AXIS,
        "head_dim": None,
        "norm": None,
        "batch": None,
        "seq": None,
        "layers": None,  # the stacked layers' leading axis
    }
)

# Logical axes of each parameter, keyed by (module name, parameter name) as in llama.py.
_PARAM_AXES: dict[tuple[str, str], tuple[str, ...]] = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),
    ("lm_head", "kernel"): ("embed", "vocab"),
    ("q_proj", "kernel"): ("embed", "heads"),
    ("k_proj", "kernel"): ("embed", "kv_heads"),
    ("v_proj", "kernel"): ("embed", "kv_heads"),
    ("o_proj", "kernel"): ("heads", "embed"),
    ("gate_proj", "kernel"): ("embed", "mlp"),
    ("up_proj", "kernel"): ("embed", "mlp"),
    ("down_proj", "kernel"): ("mlp", "embed"),
    ("q_proj", "bias"): ("heads",),
    ("k_proj", "bias"): ("kv_heads",),
    ("v_proj", "bias"): ("kv_heads",),
    ("o_proj", "bias"): ("embed",),
    ("gate_proj", "bias"): ("mlp",),
    ("up_proj", "bias"): ("mlp",),
    ("down_proj", "bias"): ("embed",),
}


def stacked_layer_param(path: Sequence[str | int]) -> bool:
    """Whether an NNX parameter path is one of the stacked layers' ([L, ...]): ('layers',
    'mlp', ...), where unrolled layers' paths are ('layers', 0, 'mlp', ...)."""
    return len(path) > 1 and str(path[0]) == "layers" and not isinstance(path[1], int) and not str(path[1]).isdigit()


def param_logical_axes(path: Sequence[str | int]) -> tuple[str, ...]:
    """The logical axes of an NNX parameter path, e.g. ('layers', 0, 'mlp', 'up_proj', 'kernel'),
    with "layers" first for a stacked layer parameter."""
    lead = ("layers",) if stacked_layer_param(path) else ()
    if len(path) >= 2 and (str(path[-2]), str(path[-1])) in _PARAM_AXES:
        return lead + _PARAM_AXES[(str(path[-2]), str(path[-1]))]
    if path and path[-1] == "scale":  # RMSNorm weights
        return lead + ("norm",)
    raise ValueError(f"no logical axes known for parameter path {tuple(path)!r}")


def param_sharding(
    path: Sequence[str | int],
    shape: Sequence[int],
    mesh: Mesh,
    rules: ShardingRules = DEFAULT_RULES,
) -> NamedSharding:
    """The NamedSharding of one parameter; the vocab stays whole when the mesh does not divide it."""
    axes = list(param_logical_axes(path))
    for i, name in enumerate(axes):
        mesh_axis = rules.rules.get(name)
        if name == "vocab" and mesh_axis is not None and shape[i] % mesh.shape[mesh_axis]:
            axes[i] = None
    return rules.sharding(mesh, *axes)


def check_divisible(config: ModelConfig, tensor_parallel_size: int) -> None:
    """Raises ValueError naming the first dimension that ``tensor_parallel_size`` does not divide."""
    for name, value in (
        ("num_heads", config.num_heads),
        ("num_kv_heads", config.num_kv_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if value % tensor_parallel_size:
            raise ValueError(f"{name}={value} not divisible by tp={tensor_parallel_size}")


def shard_model(model: nnx.Module, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> None:
    """Moves a model's parameters (e.g. a randomly initialised one) onto ``mesh`` in place."""
    state = nnx.state(model, nnx.Param)
    sharded = {
        path: jax.device_put(v.get_value(), param_sharding(path, v.get_value().shape, mesh, rules))
        for path, v in nnx.to_flat_state(state)
    }
    for path, v in nnx.to_flat_state(state):
        v.set_value(sharded[path])
    nnx.update(model, state)
