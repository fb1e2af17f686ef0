"""Loads a Hugging Face safetensors checkpoint into a sharded LlamaModel without a host copy.

The module is built abstractly (``nnx.eval_shape``: no random init), then each parameter
is made with ``jax.make_array_from_callback``: every device reads only its own slice of
the memory-mapped file, so host memory holds at most one shard of one tensor at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from lora_runtime.errors import CheckpointError
from lora_runtime.model.config import ModelConfig
from lora_runtime.model.llama import LlamaModel
from lora_runtime.model.safetensors_io import TensorInfo, read_header
from lora_runtime.model.sharding import TENSOR_AXIS, check_divisible, param_sharding

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# Buffers some exporters save that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(path: str, mesh: Mesh, *, dtype: str | None = None) -> tuple[ModelConfig, LlamaModel]:
    """Reads config.json and the safetensors weights in ``path`` into a model sharded over ``mesh``."""
    config = ModelConfig.from_pretrained(path, dtype=dtype)
    check_divisible(config, mesh.shape[TENSOR_AXIS])
    tensors = checkpoint_tensors(path)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: LlamaModel(config, rngs=nnx.Rngs(0))))
    target_dtype = np.dtype(jnp.dtype(config.dtype))
    used = set()
    arrays = {}
    for param_path, variable in nnx.to_flat_state(state):
        name = hf_name(param_path)
        info = tensors.get(name)
        if info is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {path!r}")
        used.add(name)
        shape = variable.get_value().shape
        arrays[param_path] = _load_param(param_path, name, info, shape, target_dtype, mesh)
    if config.tie_word_embeddings:
        used.add("lm_head.weight")  # some exporters save the tied copy too
    unexpected = sorted(n for n in tensors if n not in used and not n.endswith(_IGNORED_SUFFIXES))
    if unexpected:
        raise CheckpointError(
            f"checkpoint in {path!r} has {len(unexpected)} tensors the model does not use, "
            f"e.g. {unexpected[0]!r}"
        )
    nnx.replace_by_pure_dict(state, _nest(arrays))
    return config, nnx.merge(graphdef, state)


def checkpoint_tensors(path: str) -> dict[str, TensorInfo]:
    """Tensor name -> location over the checkpoint's safetensors file(s)."""
    index_path = os.path.join(path, INDEX_FILE)
    single_path = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{index_path!r} is not a safetensors index (no valid 'weight_map'): {e}"
            ) from None
        tensors = {}
        for file in sorted(set(weight_map.values())):
            headers = read_header(os.path.join(path, file))
            for name, f in weight_map.items():
                if f == file and name not in headers:
                    raise CheckpointError(f"tensor {name!r} listed in {INDEX_FILE} is missing from {file!r}")
            tensors.update(headers)
        return tensors
    if os.path.isfile(single_path):
        return read_header(single_path)
    pickles = [p for p in _PICKLE_FILES if os.path.isfile(os.path.join(path, p))]
    if pickles:
        raise CheckpointError(
            f"checkpoint in {path!r} has only {pickles[0]!r}: pickle weights are never loaded; "
            "convert it to safetensors (save_pretrained(safe_serialization=True))"
        )
    raise CheckpointError(f"checkpoint in {path!r} has neither {SINGLE_FILE!r} nor {INDEX_FILE!r}")


def hf_name(param_path: Sequence[str | int]) -> str:
    """The Hugging Face tensor name of an NNX parameter path."""
    *modules, leaf = (str(p) for p in param_path)
    suffix = "bias" if leaf == "bias" else "weight"
    prefix = [] if modules[0] == "lm_head" else ["model"]
    return ".".join(prefix + modules + [suffix])


def _load_param(
    param_path: tuple,
    name: str,
    info: TensorInfo,
    shape: tuple[int, ...],
    dtype: np.dtype,
    mesh: Mesh,
) -> jax.Array:
    """One parameter, each device reading its own slice (kernels are stored transposed)."""
    transposed = param_path[-1] == "kernel"
    expected = tuple(reversed(shape)) if transposed else tuple(shape)
    if info.shape != expected:
        raise CheckpointError(
            f"tensor {name!r} in {info.file!r} has shape {info.shape}, expected {expected}"
        )
    data = info.memmap()

    def read(index: tuple[slice, ...]) -> np.ndarray:
        if transposed:
            return np.ascontiguousarray(data[index[1], index[0]].T.astype(dtype))
        return np.ascontiguousarray(data[index].astype(dtype))

    return jax.make_array_from_callback(shape, param_sharding(param_path, shape, mesh), read)


def _nest(flat: dict[tuple, jax.Array]) -> dict:
    """{('a', 0, 'b'): x} -> {'a': {0: {'b': x}}}."""
    nested: dict = {}
    for path, value in flat.items():
        node = nested
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return nested
