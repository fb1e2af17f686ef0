"""The feed-forward activations a checkpoint's ``hidden_act`` names, as transformers computes them.

Llama-family checkpoints use "silu"; others of the same layout (and random test models)
set another name of transformers' ACT2FN. Each here is its formula in transformers
(`transformers.activations`); a name without one is refused when the config is read.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp


def _gelu_tanh(x: jax.Array) -> jax.Array:
    # gelu_new, gelu_pytorch_tanh, gelu_fast and gelu_accurate: one formula, constants rounded apart.
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def _gelu(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=False)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": _gelu,
    "gelu_python": _gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_python_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_accurate": _gelu_tanh,
    "gelu_10": lambda x: jnp.clip(_gelu(x), -10.0, 10.0),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
    "relu6": jax.nn.relu6,
    "leaky_relu": lambda x: jax.nn.leaky_relu(x, 0.01),
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x)),
    "hardswish": jax.nn.hard_swish,
    "linear": lambda x: x,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The function `hidden_act` names; a KeyError naming the supported ones otherwise
    (ModelConfig refuses such a checkpoint before a model is built)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise KeyError(f"hidden_act={name!r} is not one of {sorted(ACTIVATIONS)}") from None
