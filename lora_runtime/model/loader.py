"""Loads a Hugging Face safetensors checkpoint into a sharded LlamaModel without a host copy.

The module is built abstractly (``nnx.eval_shape``: no random init), then each parameter
is made with ``jax.make_array_from_callback``: every device reads only its own slice of
the memory-mapped file(s), so host memory holds at most one shard of one parameter at a
time (of a stacked layer parameter, that shard of every layer). Kernels, stored [out, in],
are transposed tile by tile on every core (`transpose`): a plain strided copy made that
most of a load (10.7 s of a 3 GB checkpoint on 2 cores, 3.2 s tiled).
"""

from __future__ import annotations

import concurrent.futures
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
from lora_runtime.model.sharding import TENSOR_AXIS, check_divisible, param_sharding, stacked_layer_param

SINGLE_FILE = "model.safetensors"
KV_MODULES = ("k_proj", "v_proj")
INDEX_FILE = "model.safetensors.index.json"
_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# Buffers some exporters save that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(path: str, mesh: Mesh, *, dtype: str | None = None,
               scan_layers: bool = True) -> tuple[ModelConfig, LlamaModel]:
    """Reads config.json and the safetensors weights in ``path`` into a model sharded over
    ``mesh`` (its layers stacked for a loop, or unrolled: see LlamaModel)."""
    config = ModelConfig.from_pretrained(path, dtype=dtype).for_tensor_parallel(mesh.shape[TENSOR_AXIS])
    check_divisible(config, mesh.shape[TENSOR_AXIS])
    tensors = checkpoint_tensors(path)
    abstract = nnx.eval_shape(lambda: LlamaModel(config, rngs=nnx.Rngs(0), scan_layers=scan_layers))
    graphdef, state = nnx.split(abstract)
    target_dtype = np.dtype(jnp.dtype(config.dtype))
    used = set()
    arrays = {}
    for param_path, variable in nnx.to_flat_state(state):
        stacked = stacked_layer_param(param_path)
        names = [hf_name(param_path, i) for i in range(config.num_layers)] if stacked else [hf_name(param_path)]
        infos = []
        for name in names:
            info = tensors.get(name)
            if info is None:
                raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {path!r}")
            used.add(name)
            infos.append(info)
        shape = variable.get_value().shape
        # k/v outputs past the checkpoint's kv heads copy them (ModelConfig.for_tensor_parallel).
        rows = config.kv_rows() if config.kv_head_copies > 1 and _module(param_path) in KV_MODULES else None
        arrays[param_path] = _load_param(param_path, names, infos, shape, target_dtype, mesh, stacked, rows)
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


def hf_name(param_path: Sequence[str | int], layer: int | None = None) -> str:
    """The Hugging Face tensor name of an NNX parameter path; of its layer `layer` for a
    stacked layer parameter (('layers', 'mlp', ...) holds every layer's)."""
    *modules, leaf = (str(p) for p in param_path)
    if stacked_layer_param(param_path):
        if layer is None:
            raise ValueError(f"stacked layer parameter {tuple(param_path)!r} needs the layer to name")
        modules.insert(1, str(layer))
    suffix = "bias" if leaf == "bias" else "weight"
    prefix = [] if modules[0] == "lm_head" else ["model"]
    return ".".join(prefix + modules + [suffix])


def _module(param_path: tuple) -> str:
    """The module a parameter belongs to (its path's last part before the leaf)."""
    return str(param_path[-2]) if len(param_path) > 1 else ""


def _load_param(
    param_path: tuple,
    names: list[str],
    infos: list[TensorInfo],
    shape: tuple[int, ...],
    dtype: np.dtype,
    mesh: Mesh,
    stacked: bool,
    rows: np.ndarray | None = None,
) -> jax.Array:
    """One parameter, each device reading its own slice (kernels are stored transposed); a
    stacked layer parameter reads its slice of every layer's tensor (`names`, in layer order).
    `rows`: for each output the parameter holds, the checkpoint's output it copies (copied kv heads)."""
    transposed = param_path[-1] == "kernel"
    per_layer = tuple(shape[1:]) if stacked else tuple(shape)
    stored = list(per_layer)
    if rows is not None:  # outputs: a kernel's last dimension, a bias's only one
        stored[-1] = int(rows.max()) + 1
    expected = tuple(reversed(stored)) if transposed else tuple(stored)
    for name, info in zip(names, infos):
        if info.shape != expected:
            raise CheckpointError(
                f"tensor {name!r} in {info.file!r} has shape {info.shape}, expected {expected}"
            )
    data = [info.memmap() for info in infos]

    def outputs(index: slice):
        return index if rows is None else rows[index]

    def read_one(tensor: np.ndarray, index: tuple[slice, ...], out: np.ndarray | None = None) -> np.ndarray:
        if transposed:
            return transpose(tensor[outputs(index[1]), index[0]], dtype, out)
        part = tensor[outputs(index[-1])] if rows is not None else tensor[index]
        if out is None:
            return np.ascontiguousarray(part.astype(dtype))
        out[...] = part
        return out

    def read(index: tuple[slice, ...]) -> np.ndarray:
        if not stacked:
            return read_one(data[0], index)
        layers = range(len(data))[index[0]]
        first = read_one(data[layers[0]], index[1:])
        out = np.empty((len(layers),) + first.shape, dtype)  # one device's slice of every layer
        out[0] = first
        for j, i in enumerate(layers[1:], 1):
            read_one(data[i], index[1:], out[j])  # straight into its place
        return out

    return jax.make_array_from_callback(shape, param_sharding(param_path, shape, mesh), read)


# The side of the square tiles a transposing copy moves at a time: a tile of rows and its
# transpose both stay in cache (a plain strided copy of a Llama-3-8B MLP weight runs at a
# third of this speed).
_TILE = 256
_threads: concurrent.futures.ThreadPoolExecutor | None = None


def transpose(x: np.ndarray, dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
    """x.T as a C-ordered array of `dtype` (`out`, if given), copied tile by tile on every
    core (numpy releases the interpreter lock while it copies)."""
    if out is None:
        out = np.empty(x.shape[::-1], dtype)
    if x.dtype == dtype and dtype.itemsize in (1, 2, 4, 8):  # move bits: no casting loop
        unsigned = np.dtype(f"u{dtype.itemsize}")
        x, view = x.view(unsigned), out.view(unsigned)
    else:
        view = out
    rows, cols = x.shape
    bands = [(j, min(j + _TILE, cols)) for j in range(0, cols, _TILE)]  # a band of out's rows each

    def copy(band: tuple[int, int]) -> None:
        j0, j1 = band
        for i in range(0, rows, _TILE):
            view[j0:j1, i:i + _TILE] = x[i:i + _TILE, j0:j1].T

    global _threads
    if _threads is None:
        _threads = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="load-transpose")
    list(_threads.map(copy, bands))
    return out


def _nest(flat: dict[tuple, jax.Array]) -> dict:
    """{('a', 0, 'b'): x} -> {'a': {0: {'b': x}}}."""
    nested: dict = {}
    for path, value in flat.items():
        node = nested
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return nested
