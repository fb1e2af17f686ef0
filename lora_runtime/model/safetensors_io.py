"""Lazy, memory-mapped reading of safetensors files: no tensor is copied until sliced.

The format is an 8-byte little-endian header length, a JSON header mapping each tensor
name to ``{dtype, shape, data_offsets}`` (relative to the end of the header), then the
raw little-endian data. Parsing it here (rather than through ``safetensors``) lets each
device read only its own shard's slice of a tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import ml_dtypes
import numpy as np

from lora_runtime.errors import CheckpointError

SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
# A header larger than this is not a safetensors file (the format caps it at 100 MB).
_MAX_HEADER = 100_000_000


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in a safetensors file."""

    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file

    def memmap(self) -> np.ndarray:
        """A read-only memory map of the tensor: slicing it reads only the slice's pages."""
        if not self.shape or 0 in self.shape:
            return np.zeros(self.shape, self.dtype)
        return np.memmap(self.file, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape)


def parse_entries(header: dict, data_size: int) -> dict[str, tuple[np.dtype, tuple[int, ...], int]]:
    """Tensor name -> (dtype, shape, data offset) from a parsed header; ValueError naming the bad entry.

    `data_size` is the number of bytes after the header, which every tensor must fit in.
    """
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"tensor {name!r} has unsupported dtype={entry.get('dtype')!r}")
        shape = tuple(int(s) for s in entry["shape"])
        begin, end = (int(o) for o in entry["data_offsets"])
        if not 0 <= begin <= end <= data_size or end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise ValueError(
                f"tensor {name!r}: data_offsets={[begin, end]} do not fit shape={shape} "
                f"dtype={entry['dtype']} in {data_size} data bytes"
            )
        tensors[name] = (dtype, shape, begin)
    return tensors


def split_header(prefix: bytes, size: int) -> int:
    """The header length from the first 8 bytes of a `size`-byte file; ValueError if impossible."""
    if len(prefix) < 8:
        raise ValueError(f"truncated: {size} bytes")
    (header_len,) = struct.unpack("<Q", prefix[:8])
    if header_len > size - 8:
        raise ValueError(f"{header_len=} exceeds file size {size}")
    if header_len > _MAX_HEADER:
        raise ValueError(f"{header_len=} exceeds the format's cap of {_MAX_HEADER}")
    return header_len


def read_header(path: str) -> dict[str, TensorInfo]:
    """Tensor name -> TensorInfo for one safetensors file; CheckpointError if it is malformed."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header_len = split_header(f.read(8), size)
            header = json.loads(f.read(header_len))
        entries = parse_entries(header, size - 8 - header_len)
    except FileNotFoundError:
        raise CheckpointError(f"safetensors file {path!r} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"safetensors file {path!r} has a corrupt header: {e}") from None
    except ValueError as e:
        raise CheckpointError(f"safetensors file {path!r}: {e}") from None
    data_start = 8 + header_len
    return {
        name: TensorInfo(file=path, dtype=dtype, shape=shape, offset=data_start + begin)
        for name, (dtype, shape, begin) in entries.items()
    }


def read_bytes(data: bytes) -> dict[str, np.ndarray]:
    """Tensor name -> array (zero-copy views) of a safetensors blob already in memory.

    Raises ValueError or json.JSONDecodeError naming what is malformed.
    """
    header_len = split_header(data[:8], len(data))
    header = json.loads(data[8 : 8 + header_len])
    body = memoryview(data)[8 + header_len :]
    return {
        name: np.frombuffer(body[begin : begin + int(np.prod(shape)) * dtype.itemsize], dtype=dtype).reshape(shape)
        for name, (dtype, shape, begin) in parse_entries(header, len(body)).items()
    }
